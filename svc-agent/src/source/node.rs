//! The node's devices and addresses as a source: an event a moment after the kernel reports a
//! link, address or route change.

use std::sync::Arc;
use std::time::Duration;

use futures::Stream;

use super::Event;

/// How long a burst of device and address changes may go on before the node is read again.
pub const SETTLE: Duration = Duration::from_millis(100);

/// Starts following the node's devices and addresses. A burst of changes (a device coming up
/// brings several) is one [`Event::NodeChanged`], [`SETTLE`] after its first; the kernel is no
/// longer followed once the stream is dropped.
pub fn changes() -> std::io::Result<impl Stream<Item = Event> + Send> {
    let notify = Arc::new(tokio::sync::Notify::new());
    let weak = Arc::downgrade(&notify);
    crate::netdev::watch(move || weak.upgrade().map(|n| n.notify_one()).is_some())?;
    Ok(futures::stream::unfold(notify, |notify| async move {
        notify.notified().await;
        tokio::time::sleep(SETTLE).await;
        Some((Event::NodeChanged, notify))
    }))
}
