//! Builds the real control plane the tests run against, kube-apiserver and etcd, and the real
//! kube-proxy the parity tests and benchmarks put beside svc, and helm and kubeadm for the
//! chart's and `--config`'s tests, from pinned module versions with `go build`, and caches the
//! binaries.
//!
//! Nothing of Kubernetes or etcd is committed here: the build module's go.mod is generated from
//! the pinned upstream go.mod at build time. Upstream's go.mod files point their sibling modules
//! (Kubernetes' `staging/src/k8s.io/*`, etcd's `../api` and friends) at local directories, which
//! a module fetched from the proxy does not have and whose `replace` directives are ignored in a
//! dependency anyway; so the generated go.mod replaces each of them with the same module at its
//! published version. That is also why `go install module@version` cannot be used: it refuses
//! modules whose go.mod has `replace` directives.
//!
//! Layout, under `$SVC_CONTROL_PLANE_CACHE` or `target/control-plane`:
//! `<name>-<version>/bin/<binary>`, `<name>-<version>/stamp` (the recipe the binaries were built
//! with; binaries are reused only when it matches), `<name>-<version>/build/go.mod` (generated).
//! Go's own module and build caches (GOMODCACHE, GOCACHE) keep their defaults, so a rebuild
//! after a recipe change recompiles only what changed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::{root, run};

/// The newest v1.37 patch on the Go module proxy when this was pinned.
const KUBERNETES_VERSION: &str = "v1.37.2";
/// Kubernetes publishes its staging modules (k8s.io/api, k8s.io/apiserver, ...) as v0.X.Y
/// alongside v1.X.Y.
const KUBERNETES_STAGING_VERSION: &str = "v0.37.2";
/// The newest v3.6 patch on the Go module proxy when this was pinned. (Kubernetes v1.37's own CI
/// uses etcd v3.7.0; v3.6 is a supported server for it.)
const ETCD_VERSION: &str = "v3.6.16";
/// The oldest Go that builds the pinned versions: both go.mod files say `go 1.26.0`.
const MIN_GO: (u32, u32) = (1, 26);

/// etcd's go.mod replaces modules it must never import with this nonexistent directory, so that
/// an accidental import fails loudly. There is no module to map it to; dropping the guard only
/// changes the error message such an import would give.
const GUARD_TARGET: &str = "./FORBIDDEN_DEPENDENCY";

struct Component {
    /// Directory name prefix: `<name>-<version>`.
    name: &'static str,
    module: &'static str,
    version: &'static str,
    /// The version of the modules that upstream's go.mod replaces with local directories.
    sibling_version: &'static str,
    /// (binary, main package)
    binaries: &'static [(&'static str, &'static str)],
    /// Packages whose `gitVersion`, `gitMajor` and `gitMinor` are set at link time, as
    /// Kubernetes' hack/lib/version.sh does; without them the binary reports v0.0.0-master.
    version_packages: &'static [&'static str],
    /// A variable that holds the whole version string, set at link time as the project's
    /// own release build does (Helm's Makefile sets `internal/version.version`).
    version_var: Option<&'static str>,
}

const KUBERNETES: Component = Component {
    name: "kubernetes",
    module: "k8s.io/kubernetes",
    version: KUBERNETES_VERSION,
    sibling_version: KUBERNETES_STAGING_VERSION,
    // kubectl costs under a minute more, sharing nearly all its packages with kube-apiserver,
    // and spares the harness a hand-written REST client.
    binaries: &[
        ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
        ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
    ],
    version_packages: &[
        "k8s.io/client-go/pkg/version",
        "k8s.io/component-base/version",
    ],
    version_var: None,
};

/// kube-proxy, from the same module at the same version as kube-apiserver, in a directory of
/// its own: adding it to [`KUBERNETES`] would change that component's recipe and rebuild
/// kube-apiserver and kubectl in every existing cache. With Go's build cache warm from them it
/// builds in a minute or two.
const KUBE_PROXY: Component = Component {
    name: "kube-proxy",
    module: "k8s.io/kubernetes",
    version: KUBERNETES_VERSION,
    sibling_version: KUBERNETES_STAGING_VERSION,
    binaries: &[("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy")],
    version_packages: &[
        "k8s.io/client-go/pkg/version",
        "k8s.io/component-base/version",
    ],
    version_var: None,
};

const ETCD: Component = Component {
    name: "etcd",
    module: "go.etcd.io/etcd/server/v3",
    version: ETCD_VERSION,
    sibling_version: ETCD_VERSION,
    // The etcd server module's root package is the `etcd` command.
    binaries: &[("etcd", "go.etcd.io/etcd/server/v3")],
    version_packages: &[],
    version_var: None,
};

/// kubeadm, for the KubeProxyConfiguration it writes into the kube-proxy ConfigMap (the
/// `--config` test), from the same module and version; a directory of its own for the same
/// reason as [`KUBE_PROXY`].
const KUBEADM: Component = Component {
    name: "kubeadm",
    module: "k8s.io/kubernetes",
    version: KUBERNETES_VERSION,
    sibling_version: KUBERNETES_STAGING_VERSION,
    binaries: &[("kubeadm", "k8s.io/kubernetes/cmd/kubeadm")],
    version_packages: &[
        "k8s.io/client-go/pkg/version",
        "k8s.io/component-base/version",
    ],
    version_var: None,
};

/// The newest Helm v4 patch on the Go module proxy when this was pinned; its go.mod names
/// the same client-go (v0.37.2) as the pinned Kubernetes, so the Go build cache is shared.
const HELM_VERSION: &str = "v4.3.2";

/// helm, for the chart's tests (`helm lint`, `helm template`).
const HELM: Component = Component {
    name: "helm",
    module: "helm.sh/helm/v4",
    version: HELM_VERSION,
    sibling_version: HELM_VERSION,
    binaries: &[("helm", "helm.sh/helm/v4/cmd/helm")],
    version_packages: &[],
    version_var: Some("helm.sh/helm/v4/internal/version.version"),
};

/// Paths of the built binaries.
pub struct Binaries {
    pub kube_apiserver: PathBuf,
    pub kubectl: PathBuf,
    pub etcd: PathBuf,
    pub kube_proxy: PathBuf,
    pub helm: PathBuf,
    pub kubeadm: PathBuf,
}

impl Binaries {
    /// The variables the test harness (`svc_tests::control_plane`, `svc_tests::kube_proxy`)
    /// reads.
    pub fn env(&self) -> [(&'static str, &Path); 6] {
        [
            ("SVC_KUBE_APISERVER", &self.kube_apiserver),
            ("SVC_KUBECTL", &self.kubectl),
            ("SVC_ETCD", &self.etcd),
            ("SVC_KUBE_PROXY", &self.kube_proxy),
            ("SVC_HELM", &self.helm),
            ("SVC_KUBEADM", &self.kubeadm),
        ]
    }
}

fn cache_dir() -> PathBuf {
    std::env::var_os("SVC_CONTROL_PLANE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/control-plane"))
}

/// Builds what is missing or stale, and returns the binaries. With everything cached this runs no
/// Go command at all.
pub fn ensure() -> Result<Binaries> {
    ensure_harness_tools()?;
    let cache = cache_dir();
    let mut go = None;
    let [kube_apiserver, kubectl] = build_cached(&KUBERNETES, &cache, &mut go)?
        .try_into()
        .expect("KUBERNETES lists two binaries");
    let [etcd] = build_cached(&ETCD, &cache, &mut go)?
        .try_into()
        .expect("ETCD lists one binary");
    let [kube_proxy] = build_cached(&KUBE_PROXY, &cache, &mut go)?
        .try_into()
        .expect("KUBE_PROXY lists one binary");
    let [helm] = build_cached(&HELM, &cache, &mut go)?
        .try_into()
        .expect("HELM lists one binary");
    let [kubeadm] = build_cached(&KUBEADM, &cache, &mut go)?
        .try_into()
        .expect("KUBEADM lists one binary");
    Ok(Binaries {
        kube_apiserver,
        kubectl,
        etcd,
        kube_proxy,
        helm,
        kubeadm,
    })
}

impl Component {
    fn dir(&self, cache: &Path) -> PathBuf {
        cache.join(format!("{}-{}", self.name, self.version))
    }

    fn ldflags(&self) -> String {
        // -s -w: no symbol table or DWARF; the binaries are run, not debugged, and are half the
        // size without them.
        let mut flags = String::from("-s -w");
        let (major, minor) = self.version[1..]
            .split_once('.')
            .and_then(|(major, rest)| Some((major, rest.split('.').next()?)))
            .expect("versions are vX.Y.Z");
        for package in self.version_packages {
            flags += &format!(
                " -X {package}.gitVersion={} -X {package}.gitMajor={major} -X {package}.gitMinor={minor}",
                self.version
            );
        }
        if let Some(var) = self.version_var {
            flags += &format!(" -X {var}={}", self.version);
        }
        flags
    }

    /// Everything the binaries depend on, besides the Go toolchain: a change here rebuilds.
    fn recipe(&self) -> String {
        let binaries: Vec<_> = self.binaries.iter().map(|(_, p)| *p).collect();
        format!(
            "{}@{} siblings@{} packages {} CGO_ENABLED=0 -trimpath -ldflags '{}'\n",
            self.module,
            self.version,
            self.sibling_version,
            binaries.join(" "),
            self.ldflags()
        )
    }
}

fn build_cached(c: &Component, cache: &Path, go: &mut Option<PathBuf>) -> Result<Vec<PathBuf>> {
    let dir = c.dir(cache);
    let bin = dir.join("bin");
    let stamp = dir.join("stamp");
    let paths: Vec<PathBuf> = c.binaries.iter().map(|(b, _)| bin.join(b)).collect();
    let fresh = fs::read_to_string(&stamp).is_ok_and(|s| s == c.recipe())
        && paths.iter().all(|p| p.is_file());
    if fresh {
        return Ok(paths);
    }

    let go = match go {
        Some(go) => go.clone(),
        None => go.insert(find_go()?).clone(),
    };
    let started = Instant::now();
    eprintln!(
        "building {} from {}@{} (cold: about 8 minutes on 2 cores; later runs reuse {})",
        c.binaries
            .iter()
            .map(|(b, _)| *b)
            .collect::<Vec<_>>()
            .join(", "),
        c.module,
        c.version,
        dir.display()
    );
    let build = dir.join("build");
    fs::create_dir_all(&build).with_context(|| format!("creating {}", build.display()))?;
    // Built into a fresh directory and moved into place before the stamp is written, so that an
    // interrupted build never leaves a stamp beside stale or partial binaries.
    let _ = fs::remove_file(&stamp);
    let staged = dir.join("bin.new");
    let _ = fs::remove_dir_all(&staged);
    fs::create_dir_all(&staged)?;

    let upstream = upstream_go_mod(&go, c, &build)?;
    check_go_version(&go, &upstream, c)?;
    let go_mod = generate_go_mod(c, &upstream)?;
    fs::write(build.join("go.mod"), go_mod)?;

    let mut cmd = go_command(&go, &build);
    // -mod=mod: resolve the generated go.mod's requirements and write go.sum; every module is
    // checked against the checksum database as it is downloaded.
    cmd.args([
        "build",
        "-mod=mod",
        "-trimpath",
        "-ldflags",
        &c.ldflags(),
        "-o",
    ])
    // A trailing slash makes `go build -o` write one binary per main package into it.
    .arg(format!("{}/", staged.display()));
    cmd.args(c.binaries.iter().map(|(_, p)| p));
    run(&mut cmd).with_context(|| format!("building {}@{}", c.module, c.version))?;
    for (name, package) in c.binaries {
        let built = staged.join(go_binary_name(package));
        if !built.is_file() {
            bail!("the build succeeded but {} is missing", built.display());
        }
        if built != staged.join(name) {
            fs::rename(&built, staged.join(name))?;
        }
    }
    let _ = fs::remove_dir_all(&bin);
    fs::rename(&staged, &bin)?;
    fs::write(&stamp, c.recipe())?;
    eprintln!(
        "built {}@{} in {:.0?} into {}",
        c.module,
        c.version,
        started.elapsed(),
        bin.display()
    );
    Ok(paths)
}

/// The name `go build` gives a main package's binary: the last element of its path, or the one
/// before it when that is a major version suffix (`go.etcd.io/etcd/server/v3` is `server`).
fn go_binary_name(package: &str) -> &str {
    let mut elements = package.rsplit('/');
    let last = elements.next().unwrap_or(package);
    let is_major =
        last.len() > 1 && last.starts_with('v') && last[1..].bytes().all(|b| b.is_ascii_digit());
    match elements.next() {
        Some(before) if is_major => before,
        _ => last,
    }
}

fn go_command(go: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(go);
    cmd.current_dir(dir)
        // Use the installed Go: the pinned go.mod files suggest newer toolchains (`toolchain`
        // lines), which Go would otherwise download; the `go` line is the real minimum.
        .env("GOTOOLCHAIN", "local")
        .env("GOWORK", "off")
        // Static binaries, as Kubernetes and etcd release them; and no C compiler needed.
        .env("CGO_ENABLED", "0");
    cmd
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", out.status);
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// The pinned version's own go.mod, from the module cache (downloading only that file).
fn upstream_go_mod(go: &Path, c: &Component, build: &Path) -> Result<String> {
    // Asked from the cache directory, outside the generated module, whatever state it is in.
    let path = output(go_command(go, build.parent().unwrap_or(build)).args([
        "list",
        "-m",
        "-f",
        "{{.GoMod}}",
        &format!("{}@{}", c.module, c.version),
    ]))
    .with_context(|| {
        format!(
            "looking up {}@{} on the Go module proxy (GOPROXY)",
            c.module, c.version
        )
    })?;
    let path = path.trim();
    fs::read_to_string(path).with_context(|| format!("reading {path}"))
}

/// `go X.Y[.Z]` of a go.mod.
fn go_directive(go_mod: &str) -> Option<&str> {
    go_mod
        .lines()
        .find_map(|l| l.trim().strip_prefix("go "))
        .map(str::trim)
}

fn generate_go_mod(c: &Component, upstream: &str) -> Result<String> {
    let mut replaces = Vec::new();
    let mut in_block = false;
    for line in upstream.lines() {
        let line = line.split("//").next().unwrap_or("").trim();
        let directive = if in_block {
            if line == ")" {
                in_block = false;
                continue;
            }
            line
        } else if line == "replace (" {
            in_block = true;
            continue;
        } else if let Some(rest) = line.strip_prefix("replace ") {
            rest
        } else {
            continue;
        };
        let Some((old, new)) = directive.split_once("=>") else {
            continue;
        };
        let (old, new) = (old.trim(), new.trim());
        let module = old.split_whitespace().next().unwrap_or(old);
        if new == GUARD_TARGET {
            continue;
        }
        if new.starts_with("./") || new.starts_with("../") {
            // A sibling module in upstream's source tree: the same module as published.
            replaces.push(format!("\t{module} => {module} {}", c.sibling_version));
        } else if new.starts_with('/') {
            bail!("{}@{}: cannot map replace {directive}", c.module, c.version);
        } else {
            // A pin to another version or fork: kept, as upstream builds with it.
            replaces.push(format!("\t{old} => {new}"));
        }
    }
    let go_line = go_directive(upstream).context("upstream go.mod has no go directive")?;
    // `godebug` lines set the binary's default GODEBUG settings, and count only in the main
    // module, which the generated module now is.
    let godebug: Vec<&str> = upstream
        .lines()
        .filter(|l| l.starts_with("godebug"))
        .collect();
    let mut sections = vec![
        format!(
            "// Generated by `cargo xtask control-plane` from {}@{}'s go.mod: do not edit.\n\
             module svc.invalid/control-plane-build/{}",
            c.module, c.version, c.name
        ),
        format!("go {go_line}"),
    ];
    if !godebug.is_empty() {
        sections.push(godebug.join("\n"));
    }
    sections.push(format!("require {} {}", c.module, c.version));
    if !replaces.is_empty() {
        sections.push(format!("replace (\n{}\n)", replaces.join("\n")));
    }
    Ok(sections.join("\n\n") + "\n")
}

/// Parses `go1.26.8`, `1.26`, `1.19~1` and the like into (major, minor).
fn parse_go_version(v: &str) -> Option<(u32, u32)> {
    let v = v.trim().trim_start_matches("go");
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn go_version(go: &Path) -> Result<(String, (u32, u32))> {
    let v = output(Command::new(go).args(["env", "GOVERSION"]))?;
    let v = v.trim().to_string();
    let parsed = parse_go_version(&v).with_context(|| format!("unexpected Go version {v:?}"))?;
    Ok((v, parsed))
}

fn check_go_version(go: &Path, upstream: &str, c: &Component) -> Result<()> {
    let (have, parsed) = go_version(go)?;
    let want = go_directive(upstream).and_then(parse_go_version);
    if want.is_some_and(|want| parsed < want) {
        bail!(
            "{}@{} needs Go {} or newer, and {} is {have}",
            c.module,
            c.version,
            go_directive(upstream).unwrap_or("?"),
            go.display()
        );
    }
    eprintln!("using {} ({have})", go.display());
    Ok(())
}

fn find_go() -> Result<PathBuf> {
    let found = ["go", "/usr/local/go/bin/go", "/usr/lib/go/bin/go"]
        .into_iter()
        .map(PathBuf::from)
        .find(|go| go_version(go).is_ok());
    let Some(go) = found else {
        return install_debian_go();
    };
    let (have, parsed) = go_version(&go)?;
    if parsed < MIN_GO {
        bail!(
            "{} is {have}; building kube-apiserver {KUBERNETES_VERSION} and etcd {ETCD_VERSION} \
             needs Go {}.{} or newer: install it (its bin directory first on PATH)",
            go.display(),
            MIN_GO.0,
            MIN_GO.1
        );
    }
    Ok(go)
}

/// Debian's Go, if it is new enough (Debian 12's is 1.19, which is not): said clearly either way.
fn install_debian_go() -> Result<PathBuf> {
    let need = format!(
        "building kube-apiserver {KUBERNETES_VERSION} and etcd {ETCD_VERSION} needs Go {}.{} \
         or newer, and no `go` is installed",
        MIN_GO.0, MIN_GO.1
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{need}: install it (its bin directory on PATH)");
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    let policy = output(Command::new("apt-cache").args(["policy", "golang-go"]))?;
    let candidate = policy
        .lines()
        .find_map(|l| l.trim().strip_prefix("Candidate:"))
        .map(str::trim)
        .unwrap_or("(none)");
    // Debian versions carry an epoch: `2:1.19~1`.
    let version = candidate.rsplit(':').next().and_then(parse_go_version);
    if version.is_none_or(|v| v < MIN_GO) {
        bail!("{need}; Debian's golang-go is {candidate}, too old: install Go from go.dev (its bin directory on PATH)");
    }
    run(Command::new("apt-get")
        .args([
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "golang-go",
        ])
        .env("DEBIAN_FRONTEND", "noninteractive"))?;
    Ok(PathBuf::from("/usr/bin/go"))
}

/// Commands the harness runs, and the Debian package of each: kube-proxy runs
/// `iptables`/`ip6tables` (both backends: Debian's default iptables-nft and iptables-legacy, from
/// the one `iptables` package), `nft` and `conntrack` inside the test's network namespaces.
const HARNESS_TOOLS: &[(&str, &str)] = &[
    ("iptables-legacy", "iptables"),
    ("iptables-nft", "iptables"),
    ("nft", "nftables"),
    ("conntrack", "conntrack"),
    // The image test (tests/tests/image.rs) builds the node image with it.
    ("buildah", "buildah"),
    // The XDP packet test and the parity suite's XDP column turn transmit checksum offload
    // off in their namespaces.
    ("ethtool", "ethtool"),
];

/// Whether `command` is on PATH (or in /usr/sbin, which a non-root PATH may lack).
fn have_command(command: &str) -> bool {
    let in_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    in_path
        .into_iter()
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|dir| dir.join(command).is_file())
}

/// Installs the Debian packages of whatever harness command is missing, idempotently: with
/// everything present this runs nothing.
fn ensure_harness_tools() -> Result<()> {
    let mut missing: Vec<&str> = HARNESS_TOOLS
        .iter()
        .filter(|(command, _)| !have_command(command))
        .map(|(_, package)| *package)
        .collect();
    missing.dedup();
    if missing.is_empty() {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Only the parity tests need these, and they run as root, which installs them.
        eprintln!(
            "note: the kube-proxy parity tests need `apt-get install {}` (run as root to install)",
            missing.join(" ")
        );
        return Ok(());
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse() {
        assert_eq!(parse_go_version("go1.26.8"), Some((1, 26)));
        assert_eq!(parse_go_version("1.19~1"), Some((1, 19)));
        assert_eq!(parse_go_version("1.26.0"), Some((1, 26)));
        assert_eq!(parse_go_version("go1.27rc1"), Some((1, 27)));
    }

    #[test]
    fn binary_names_follow_go_build() {
        assert_eq!(go_binary_name("k8s.io/kubernetes/cmd/kubectl"), "kubectl");
        assert_eq!(go_binary_name("go.etcd.io/etcd/server/v3"), "server");
    }

    #[test]
    fn kubernetes_ldflags_name_the_version() {
        let flags = KUBERNETES.ldflags();
        assert!(flags
            .contains("-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"));
        assert_eq!(ETCD.ldflags(), "-s -w");
    }

    #[test]
    fn local_replacements_become_published_siblings() {
        let upstream = "module go.etcd.io/etcd/server/v3\n\ngo 1.26.0\n\ntoolchain go1.26.10\n\n\
            require (\n\tgo.etcd.io/etcd/api/v3 v3.6.16\n)\n\n\
            replace (\n\tgo.etcd.io/etcd/api/v3 => ../api\n\tgo.etcd.io/etcd/pkg/v3 => ../pkg // why\n)\n\n\
            replace go.etcd.io/etcd => ./FORBIDDEN_DEPENDENCY\n\
            replace example.com/x v1.0.0 => example.com/y v1.0.1\n";
        let generated = generate_go_mod(&ETCD, upstream).unwrap();
        assert!(generated.contains("go 1.26.0\n"));
        assert!(!generated.contains("toolchain"));
        assert!(generated.contains("require go.etcd.io/etcd/server/v3 v3.6.16\n"));
        assert!(generated.contains("\tgo.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 v3.6.16\n"));
        assert!(generated.contains("\tgo.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 v3.6.16\n"));
        assert!(generated.contains("\texample.com/x v1.0.0 => example.com/y v1.0.1\n"));
        assert!(!generated.contains("FORBIDDEN"));
    }
}
