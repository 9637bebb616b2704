use std::path::PathBuf;

/// Errors of the agent. Each names what it was about, so a log line alone tells the operator
/// which object or file to look at.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: document {doc}: {message}")]
    Manifest {
        path: PathBuf,
        doc: usize,
        message: String,
    },

    #[error("{object}: {message}")]
    Invalid { object: String, message: String },

    /// `errno`: the kernel's answer when a system call failed (the message says it too), so
    /// that callers match on the value, never on the text.
    #[error("map {map}: {message}")]
    Map {
        map: &'static str,
        message: String,
        errno: Option<Errno>,
    },

    #[error("map {map} is full ({capacity} entries): {object} not programmed")]
    MapFull {
        map: &'static str,
        capacity: u32,
        object: String,
    },

    /// Work inside one network namespace failed; `netns` names it and the process and cgroup
    /// it was found through.
    #[error("network namespace {netns}: {message}")]
    Netns { netns: String, message: String },

    /// A healthCheckNodePort server could not listen on one address.
    #[error("Service {service}: healthCheckNodePort {port} on {addr}: {source}")]
    HealthCheck {
        service: String,
        port: u16,
        addr: String,
        #[source]
        source: std::io::Error,
    },

    /// Loading, attaching or adopting the datapath failed; `errno` where a system call said
    /// why (EPERM and EACCES: a privilege is missing).
    #[error("loading eBPF programs: {message}")]
    Load {
        message: String,
        errno: Option<Errno>,
    },

    /// Another process owns the bpffs directory.
    #[error(
        "{} is in use by {holder}: one svc-agent serves a directory at a time; stop it first \
         (or give this one another --bpffs)",
        dir.display()
    )]
    Locked { dir: PathBuf, holder: String },

    #[error("{0}")]
    Other(String),
}

/// An errno a system call answered (`libc::E2BIG`, ...), as a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Errno(pub i32);

impl Error {
    /// A map error of no system call (a rule of the agent's).
    pub fn map(map: &'static str, message: String) -> Error {
        Error::Map {
            map,
            message,
            errno: None,
        }
    }

    /// A map error from a failed system call `cause`, its errno kept.
    pub fn map_io(map: &'static str, message: String, cause: &std::io::Error) -> Error {
        Error::Map {
            map,
            message,
            errno: cause.raw_os_error().map(Errno),
        }
    }

    /// A datapath error of no system call (a rule of the agent's, a missing program).
    pub fn load(message: String) -> Error {
        Error::Load {
            message,
            errno: None,
        }
    }

    /// The errno of the system call this error comes from, where it has one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            Error::Map { errno, .. } | Error::Load { errno, .. } => *errno,
            Error::Io { source, .. } | Error::HealthCheck { source, .. } => {
                source.raw_os_error().map(Errno)
            }
            _ => None,
        }
    }

    /// A short stable name for metrics: errors counted by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Manifest { .. } => "manifest",
            Error::Invalid { .. } => "invalid_object",
            Error::Map { .. } => "map",
            Error::MapFull { .. } => "map_full",
            Error::Netns { .. } => "netns",
            Error::HealthCheck { .. } => "health_check",
            Error::Load { .. } => "load",
            Error::Locked { .. } => "locked",
            Error::Other(_) => "other",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error with its causes, `top: cause: cause...`: kube's errors say "client error
/// (Connect)" at the top and the OS error ("Connection refused (os error 111)") only at the
/// bottom. A cause whose text the message already holds is not repeated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let t = cause.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        source = cause.source();
    }
    text
}
