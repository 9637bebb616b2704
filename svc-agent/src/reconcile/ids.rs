//! Ids of frontends and backends: never handed out twice (see the module above).

/// Ids handed out so far, and how far they are durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ids {
    pub next_frontend: u32,
    pub next_backend: u32,
    /// Every id below these may be in use somewhere (META holds them).
    pub frontend_hwm: u32,
    pub backend_hwm: u32,
}

impl Default for Ids {
    fn default() -> Self {
        // 0 is no id: markers carry frontend id 0 and the kernel reads backend 0 as "missing".
        Ids {
            next_frontend: 1,
            next_backend: 1,
            frontend_hwm: 0,
            backend_hwm: 0,
        }
    }
}
