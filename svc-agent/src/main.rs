use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use svc_agent::{agent, datapath, list, sys, translate::NodeContext};

/// svc: Kubernetes Services through eBPF socket hooks, in place of kube-proxy.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Attach the datapath to a cgroup and keep it in sync with manifest files.
    Run {
        /// A YAML file (several documents allowed) or a directory of them, holding v1 Service
        /// and discovery.k8s.io/v1 EndpointSlice objects.
        #[arg(long)]
        manifests: PathBuf,
        /// The cgroup (v2) whose sockets are served, e.g. /sys/fs/cgroup/kubepods.
        #[arg(long)]
        cgroup: PathBuf,
        /// Where maps and links are pinned.
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// This node's name, for internalTrafficPolicy: Local.
        #[arg(long)]
        node_name: Option<String>,
        /// How often the manifests are checked for changes, in milliseconds.
        #[arg(long, default_value_t = 200)]
        poll_ms: u64,
    },
    /// Print each service frontend with its backends, from the pinned maps.
    List {
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        #[arg(short, long, value_enum, default_value = "text")]
        output: Output,
    },
    /// Detach the programs and remove every pinned map and link.
    Uninstall {
        #[arg(long, default_value = datapath::DEFAULT_BPFFS)]
        bpffs: PathBuf,
        /// Also check that no socket program is left attached to this cgroup.
        #[arg(long)]
        cgroup: Option<PathBuf>,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match Cli::parse().command {
        Command::Run {
            manifests,
            cgroup,
            bpffs,
            node_name,
            poll_ms,
        } => {
            let cfg = agent::RunConfig {
                manifests,
                cgroup,
                bpffs,
                node: NodeContext {
                    node_name,
                    zone: None,
                },
                poll: Duration::from_millis(poll_ms.max(10)),
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            rt.block_on(agent::run(cfg))?;
        }
        Command::List { bpffs, output } => {
            let store = datapath::open_pinned(&bpffs)?;
            let listing = list::read(&store)?;
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&listing)?),
                Output::Text => print!("{}", list::render_text(&listing)),
            }
        }
        Command::Uninstall { bpffs, cgroup } => {
            for p in datapath::uninstall(&bpffs)? {
                println!("removed {}", p.display());
            }
            if let Some(cg) = cgroup {
                check_detached(&cg)?;
            }
        }
    }
    Ok(())
}

/// Links detach once the last holder lets go; a running agent still holds them.
fn check_detached(cgroup: &std::path::Path) -> anyhow::Result<()> {
    let f = std::fs::File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let mut left = Vec::new();
        for (t, name) in sys::SOCK_ADDR_ATTACH_TYPES {
            let n = sys::attached_programs(f.as_fd(), t)
                .with_context(|| format!("querying {} at {name}", cgroup.display()))?;
            if n > 0 {
                left.push(format!("{name}: {n}"));
            }
        }
        if left.is_empty() {
            println!("no socket programs attached to {}", cgroup.display());
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "programs still attached to {} ({}); is an svc-agent still running?",
                cgroup.display(),
                left.join(", ")
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
