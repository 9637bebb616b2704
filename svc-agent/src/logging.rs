//! The agent's log: where it goes (stderr), how much (`--v`, `--log-level`, else `RUST_LOG`,
//! else info) and in which shape (`--logging-format`): tracing's own lines, kube-proxy's klog
//! lines, or one JSON object per line for log pipelines.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// `2026-12-05T16:31:44.123456Z  INFO svc_agent::controller: message key=value`
    Text,
    /// kube-proxy's (klog's): `I1205 16:31:44.123456   12345 controller.rs:120] message key=value`
    Klog,
    /// One JSON object per line: timestamp, level, target, fields.
    Json,
}

/// What to log: `level` (error, warn, info, debug, trace, or an EnvFilter directive such as
/// `info,svc_agent=debug`) if given, else klog verbosity `v` if given (0-1: info; 2-3: the
/// agent's debug lines; 4-5: its trace lines; 6 and above: every crate's trace lines, the
/// API client's included), else `RUST_LOG`, else info.
pub fn filter(level: Option<&str>, v: Option<u8>) -> EnvFilter {
    let from_v = v.map(|v| match v {
        0 | 1 => "info",
        2 | 3 => "info,svc_agent=debug",
        4 | 5 => "info,svc_agent=trace",
        _ => "trace",
    });
    match level.or(from_v) {
        Some(directive) => EnvFilter::new(directive),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    }
}

/// Installs the process's subscriber.
pub fn init(format: Format, filter: EnvFilter) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        Format::Text => builder.with_ansi(ansi).init(),
        Format::Json => builder.json().flatten_event(true).init(),
        Format::Klog => builder.with_ansi(false).event_format(Klog).init(),
    }
}

/// klog's header (`Lmmdd hh:mm:ss.uuuuuu pid file:line] `), written by hand: no crate writes
/// klog's shape for tracing.
pub struct Klog;

impl<S, N> FormatEvent<S, N> for Klog
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let letter = match *meta.level() {
            Level::ERROR => 'E',
            Level::WARN => 'W',
            Level::INFO => 'I',
            // klog has no lower level: its verbose lines are I lines too.
            Level::DEBUG | Level::TRACE => 'I',
        };
        let mut now = String::new();
        SystemTime.format_time(&mut Writer::new(&mut now))?;
        write!(w, "{letter}{} {:>7} ", klog_time(&now), std::process::id())?;
        match (meta.file(), meta.line()) {
            (Some(file), Some(line)) => {
                let file = file.rsplit('/').next().unwrap_or(file);
                write!(w, "{file}:{line}] ")?;
            }
            _ => write!(w, "{}] ", meta.target())?,
        }
        ctx.field_format().format_fields(w.by_ref(), event)?;
        writeln!(w)
    }
}

/// `2026-12-05T16:31:44.123456Z` (RFC 3339, UTC) as klog writes it: `1205 16:31:44.123456`.
fn klog_time(rfc3339: &str) -> String {
    let date = rfc3339.get(5..10).unwrap_or("").replace('-', "");
    let time = rfc3339
        .get(11..)
        .unwrap_or("")
        .trim_end_matches('Z')
        .to_string();
    format!("{date} {time}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn klog_time_is_month_day_and_microseconds() {
        assert_eq!(
            klog_time("2026-12-05T16:31:44.123456Z"),
            "1205 16:31:44.123456"
        );
    }

    #[test]
    fn a_level_flag_beats_verbosity_which_beats_nothing() {
        assert_eq!(filter(Some("warn"), Some(4)).to_string(), "warn");
        assert_eq!(filter(None, Some(2)).to_string(), "svc_agent=debug,info");
        assert_eq!(filter(None, Some(0)).to_string(), "info");
    }
}
