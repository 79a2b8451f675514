//! A real `HAProxy` (Debian's package) run in the foreground by a test, under a command name of its
//! own (a symlink), so each test's agent traces only that test's `HAProxy`.
//!
//! Two versions ([`Version`]): Debian 12's 2.6 from the host (`/usr/sbin/haproxy`), and Debian 13's
//! 3.0 from a minimal trixie tree that `make setup` makes with debootstrap (`.tools/trixie`). The
//! latter runs the way a container does: the tree as its root (`pivot_root`), in mount and pid namespaces of its
//! own, with its own `/proc`, a read-only `/sys` and a private `/dev/shm`; its symlink and
//! configuration live inside the tree, so the agent sees them only through `/proc/PID/root`.
//! [`Version::from_env`] picks the default for tests that do not choose:
//! `TRACETAP_TESTS_HAPROXY=debian13` runs every test on 3.0.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A command name unique to this test process and call (at most 15 bytes, as the kernel keeps).
#[must_use]
pub fn unique_comm() -> String {
    format!("hap{}x{}", std::process::id() % 100_000, NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Which `HAProxy` a test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Version {
    /// Debian 12's `HAProxy` 2.6, the host's package, run directly.
    #[default]
    Debian12,
    /// Debian 13's `HAProxy` 3.0 from the debootstrapped tree ([`trixie_root`]), as its root, in mount
    /// and pid namespaces of its own.
    Debian13,
}

/// Every version, for tests that run one scenario against each.
#[must_use]
pub fn versions() -> [Version; 2] {
    [Version::Debian12, Version::Debian13]
}

impl Version {
    /// The version tests run when they do not choose: `TRACETAP_TESTS_HAPROXY` (`debian12` or
    /// `2.6`, `debian13` or `3.0`), else Debian 12's.
    ///
    /// # Panics
    /// On any other value, so a typo does not silently test the default.
    #[must_use]
    pub fn from_env() -> Self {
        match std::env::var("TRACETAP_TESTS_HAPROXY").as_deref() {
            Err(_) | Ok("" | "debian12" | "2.6") => Self::Debian12,
            Ok("debian13" | "3.0") => Self::Debian13,
            Ok(other) => panic!("TRACETAP_TESTS_HAPROXY={other:?}: expected debian12 (2.6) or debian13 (3.0)"),
        }
    }

    /// `HAProxy`'s version: "2.6" or "3.0".
    #[must_use]
    pub fn number(self) -> &'static str {
        match self {
            Self::Debian12 => "2.6",
            Self::Debian13 => "3.0",
        }
    }

    /// For messages: "HAProxy 2.6 (Debian 12)".
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Debian12 => "HAProxy 2.6 (Debian 12)",
            Self::Debian13 => "HAProxy 3.0 (Debian 13)",
        }
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The Debian 13 tree: `TRACETAP_TRIXIE_ROOT`, else `.tools/trixie` of this checkout.
///
/// # Panics
/// When it has no `HAProxy` (run `make setup`).
#[must_use]
pub fn trixie_root() -> PathBuf {
    tree("TRACETAP_TRIXIE_ROOT", "trixie", "Debian 13")
}

fn tree(var: &str, name: &str, debian: &str) -> PathBuf {
    let root = std::env::var_os(var)
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools").join(name), PathBuf::from);
    assert!(
        root.join("usr/sbin/haproxy").exists(),
        "{} has no usr/sbin/haproxy: run `make setup` (debootstraps {debian} with haproxy there)",
        root.display()
    );
    root.canonicalize().expect("canonical tree root")
}

/// The Debian 12 tree with `HAProxy` 2.6 that pod-shaped tests run as a container's root:
/// `TRACETAP_BOOKWORM_ROOT`, else `.tools/bookworm-haproxy` of this checkout.
///
/// # Panics
/// When it has no `HAProxy` (run `make setup`).
#[must_use]
pub fn bookworm_root() -> PathBuf {
    tree("TRACETAP_BOOKWORM_ROOT", "bookworm-haproxy", "Debian 12")
}

/// Where an instance's symlink and configuration live inside the trixie tree, as `HAProxy` 3.0
/// sees them (one directory per instance: parallel tests share the tree, never a file in it).
const CHROOT_INSTANCES: &str = "tracetap-test";

/// Runs as pid 1 of the new pid namespace (arguments: tree, cgroup directory or empty, hostname or
/// empty, then `HAProxy`'s command line): enters the pod's cgroup and sets the hostname when given,
/// mounts what a container has, makes the tree the root with `pivot_root` (as runc does, so that
/// `/proc/PID/maps` shows paths inside the tree to readers in other mount namespaces), starts
/// `HAProxy`, and stays while any process of the namespace lives (a `-sf` successor started by
/// `nsenter` outlives the first process; when pid 1 exits the kernel kills the whole namespace).
/// `set --` and the glob run in the shell itself, so no helper process is counted.
const NAMESPACE_INIT: &str = r#"root=$1 cgroup=$2 hostname=$3; shift 3
{ [ -z "$cgroup" ] || echo $$ > "$cgroup/cgroup.procs"; } && { [ -z "$hostname" ] || echo "$hostname" > /proc/sys/kernel/hostname; } || exit 125
mount --bind "$root" "$root" && mount -t proc proc "$root/proc" && mount -t sysfs -o ro sysfs "$root/sys" && mount -t tmpfs -o mode=1777 shm "$root/dev/shm" || exit 125
cd "$root" && pivot_root . . && umount -l . && cd / || exit 125
"$@" &
wait $!
status=$?
while set -- /proc/[0-9]*; [ $# -gt 1 ]; do sleep 0.2; done
exit $status"#;

#[derive(Debug)]
pub struct Haproxy {
    pub comm: String,
    pub version: Version,
    /// Host directory of this instance: stderr files (and, for Debian 12, the symlink and config).
    dir: PathBuf,
    /// Host path of the configuration.
    config: PathBuf,
    /// Debian 13: the instance's directory inside the tree, as seen from the host and from inside.
    chroot: Option<Chroot>,
    /// What the test spawned: `haproxy` (Debian 12), `unshare` then `nsenter` (Debian 13).
    children: Vec<Child>,
    /// Host pid of the `HAProxy` process each child started.
    pids: Vec<u32>,
    /// Environment variables `HAProxy` is started with (besides the test's own).
    env: Vec<(String, String)>,
}

/// How an instance starts besides its version, name and configuration.
#[derive(Debug, Default)]
struct Launch {
    args: Vec<String>,
    env: Vec<(String, String)>,
    pod: Option<PodShape>,
}

/// What makes a chrooted `HAProxy` a pod's container: the kubelet-shaped cgroup it runs in (a
/// cgroup v2 directory, made by the test) and the pod's hostname.
#[derive(Debug, Clone)]
pub struct PodShape {
    pub cgroup: PathBuf,
    pub hostname: String,
}

#[derive(Debug)]
struct Chroot {
    root: PathBuf,
    pod: Option<PodShape>,
    /// e.g. `/tracetap-test/hap123x4`.
    inner: PathBuf,
    /// Host pid of the namespace's pid 1 (the shell under `unshare`), once known.
    init: Option<u32>,
}

/// The Debian 12 `haproxy` binary of this host.
#[must_use]
pub fn haproxy_binary() -> PathBuf {
    for p in ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy", "/usr/bin/haproxy"] {
        if std::path::Path::new(p).exists() {
            return p.into();
        }
    }
    panic!("haproxy is not installed; run `make setup` (apt-get install haproxy)");
}

impl Haproxy {
    /// Starts `HAProxy` ([`Version::from_env`]) with `config` under command name `comm`, and waits
    /// until `wait_port` accepts connections.
    #[must_use]
    pub fn start(comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_on(Version::from_env(), comm, config, wait_port)
    }

    /// [`Haproxy::start`] with the given version.
    #[must_use]
    pub fn start_on(version: Version, comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_at(version, comm, comm, config, wait_port, &[])
    }

    /// [`Haproxy::start`] with these environment variables (for `"${VAR}"` in `config`).
    #[must_use]
    pub fn start_with_env(comm: &str, config: &str, wait_port: u16, env: &[(&str, String)]) -> Self {
        let env = env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
        Self::start_full(Version::from_env(), comm, comm, config, wait_port, Launch { env, ..Launch::default() })
    }

    /// Master-worker mode (`-W`): a master process that forks the worker and reloads on SIGUSR2.
    #[must_use]
    pub fn start_master_worker(comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_master_worker_on(Version::from_env(), comm, config, wait_port)
    }

    /// [`Haproxy::start_master_worker`] on the given version.
    #[must_use]
    pub fn start_master_worker_on(version: Version, comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_at(version, comm, comm, config, wait_port, &["-W".to_owned()])
    }

    /// Another instance with the same command name, in a directory of its own (`instance`).
    #[must_use]
    pub fn start_in(comm: &str, instance: &str, config: &str, wait_port: u16) -> Self {
        Self::start_at(Version::from_env(), comm, &format!("{comm}-{instance}"), config, wait_port, &[])
    }

    fn start_at(version: Version, comm: &str, dir_name: &str, config: &str, wait_port: u16, args: &[String]) -> Self {
        let how = Launch { args: args.to_vec(), ..Launch::default() };
        Self::start_full(version, comm, dir_name, config, wait_port, how)
    }

    /// `HAProxy` as a pod's container: `version`'s Debian tree as its root (Debian 12's 2.6 from
    /// [`bookworm_root`], 3.0 from [`trixie_root`]), in its own mount, pid and UTS namespaces,
    /// with `pod`'s hostname and in `pod`'s cgroup from its first process on.
    #[must_use]
    pub fn start_in_pod(version: Version, comm: &str, config: &str, wait_port: u16, pod: PodShape) -> Self {
        Self::start_full(version, comm, comm, config, wait_port, Launch { pod: Some(pod), ..Launch::default() })
    }

    fn start_full(version: Version, comm: &str, dir_name: &str, config: &str, wait_port: u16, how: Launch) -> Self {
        let dir = std::env::temp_dir().join(format!("tracetap-e2e-{dir_name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (config_path, chroot) = match (version, how.pod) {
            (Version::Debian12, None) => {
                std::os::unix::fs::symlink(haproxy_binary(), dir.join(comm)).expect("symlink haproxy");
                (dir.join("haproxy.cfg"), None)
            }
            (_, pod) => {
                let root = if version == Version::Debian12 { bookworm_root() } else { trixie_root() };
                let inner = PathBuf::from("/").join(CHROOT_INSTANCES).join(dir_name);
                let host = host_path(&root, &inner);
                let _ = std::fs::remove_dir_all(&host);
                std::fs::create_dir_all(&host).expect("instance dir in the container root");
                std::os::unix::fs::symlink("/usr/sbin/haproxy", host.join(comm)).expect("symlink haproxy");
                (host.join("haproxy.cfg"), Some(Chroot { root, pod, inner, init: None }))
            }
        };
        std::fs::write(&config_path, config).expect("write config");
        let mut h = Self {
            comm: comm.to_owned(),
            version,
            dir,
            config: config_path,
            chroot,
            children: Vec::new(),
            pids: Vec::new(),
            env: how.env,
        };
        h.spawn(&how.args);
        h.wait_port(wait_port);
        h.find_pid();
        h
    }

    fn spawn(&mut self, extra: &[String]) {
        let stderr = std::fs::File::create(self.dir.join(format!("stderr.{}", self.children.len()))).expect("log file");
        let mut cmd = match &self.chroot {
            None => {
                let mut cmd = Command::new(self.dir.join(&self.comm));
                cmd.arg("-db").arg("-f").arg(&self.config);
                cmd
            }
            Some(chroot) => {
                let mut cmd = match chroot.init {
                    // The first process: new namespaces, the shell above as their pid 1. Killing
                    // `unshare` kills that shell (--kill-child), and with it the namespace.
                    None => {
                        let mut cmd = Command::new("unshare");
                        cmd.args([
                            "--mount",
                            "--pid",
                            "--uts",
                            "--fork",
                            "--kill-child",
                            "--",
                            "sh",
                            "-c",
                            NAMESPACE_INIT,
                        ])
                        .arg("tracetap-ns")
                        .arg(&chroot.root)
                        .arg(chroot.pod.as_ref().map(|p| p.cgroup.clone()).unwrap_or_default())
                        .arg(chroot.pod.as_ref().map(|p| p.hostname.as_str()).unwrap_or_default());
                        cmd
                    }
                    // A successor (reload): in the same namespaces and the pod's cgroup, as a
                    // reload in a container is.
                    Some(init) => {
                        let mut cmd = Command::new("sh");
                        let cgroup = chroot.pod.as_ref().map(|p| p.cgroup.clone()).unwrap_or_default();
                        cmd.args([
                            "-c",
                            r#"{ [ -z "$1" ] || echo $$ > "$1/cgroup.procs"; } && shift && exec "$@""#,
                            "sh",
                        ])
                        .arg(cgroup)
                        .args(["nsenter", "--target", &init.to_string()])
                        .args(["--mount", "--pid", "--uts", "--root", "--wd", "--"]);
                        cmd
                    }
                };
                cmd.arg(chroot.inner.join(&self.comm)).arg("-db").arg("-f").arg(chroot.inner.join("haproxy.cfg"));
                cmd
            }
        };
        let child = cmd
            .args(extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start haproxy");
        self.children.push(child);
    }

    /// Records the host pid of the `HAProxy` process the newest child started: the child itself,
    /// or (Debian 13) its nearest descendant with this command name (the master, with `-W`).
    fn find_pid(&mut self) {
        let spawned = self.children.last().expect("started").id();
        let pid = match &mut self.chroot {
            None => spawned,
            Some(chroot) => {
                let found = crate::wait_for(Duration::from_secs(10), || descendant_named(spawned, &self.comm));
                let (pid, path) = found.unwrap_or_else(|| panic!("no process named {} under pid {spawned}", self.comm));
                if chroot.init.is_none() {
                    // unshare -> namespace init (shell) -> HAProxy
                    chroot.init = Some(path[1]);
                }
                pid
            }
        };
        self.pids.push(pid);
    }

    fn wait_port(&self, port: u16) {
        let up = crate::wait_for(Duration::from_secs(10), || std::net::TcpStream::connect(("127.0.0.1", port)).ok());
        if up.is_none() {
            let log = std::fs::read_to_string(self.dir.join(format!("stderr.{}", self.children.len() - 1)))
                .unwrap_or_default();
            panic!(
                "{} did not listen on port {port}; its stderr:\n{log}\nconfig:\n{}",
                self.version,
                self.config_text()
            );
        }
    }

    /// The configuration `HAProxy` runs with.
    #[must_use]
    pub fn config_text(&self) -> String {
        std::fs::read_to_string(&self.config).expect("config")
    }

    /// Replaces the configuration file (the next reload reads it).
    pub fn rewrite_config(&self, config: &str) {
        std::fs::write(&self.config, config).expect("write config");
    }

    /// Host pid of the newest `HAProxy` process (the master, in master-worker mode).
    #[must_use]
    pub fn pid(&self) -> u32 {
        *self.pids.last().expect("started")
    }

    /// Master-worker reload: SIGUSR2 to the master, which starts a new worker; the old one
    /// finishes its connections and exits.
    pub fn reload_master(&self) {
        let status = Command::new("kill").arg("-USR2").arg(self.pid().to_string()).status().expect("kill");
        assert!(status.success());
    }

    /// Seamless reload: a new process takes over the listeners (`-sf old`), the old one finishes
    /// its connections and exits. Debian 13: the new process starts in the same namespaces, and
    /// `-sf` names the old one by its pid there.
    pub fn reload(&mut self, wait_port: u16) {
        let old = self.pid();
        let old = if self.chroot.is_some() { namespace_pid(old) } else { old };
        self.spawn(&["-sf".to_owned(), old.to_string()]);
        self.wait_port(wait_port);
        self.find_pid();
    }
}

/// `root` joined with the absolute path `inner` (as seen inside the chroot).
/// The directory of the instance [`Haproxy::start_on`] starts under command name `comm`: as
/// `HAProxy` sees it (for paths in its configuration, such as a `stats socket`) and as the host
/// sees it. Created (afresh) when the instance starts.
#[must_use]
pub fn instance_paths(version: Version, comm: &str) -> (PathBuf, PathBuf) {
    match version {
        Version::Debian12 => {
            let dir = std::env::temp_dir().join(format!("tracetap-e2e-{comm}"));
            (dir.clone(), dir)
        }
        Version::Debian13 => {
            let inner = PathBuf::from("/").join(CHROOT_INSTANCES).join(comm);
            let host = host_path(&trixie_root(), &inner);
            (inner, host)
        }
    }
}

fn host_path(root: &std::path::Path, inner: &std::path::Path) -> PathBuf {
    root.join(inner.strip_prefix("/").unwrap_or(inner))
}

/// (pid, parent pid, command name) of every process.
fn processes() -> Vec<(u32, u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            let (open, close) = (stat.find('(')?, stat.rfind(')')?);
            let parent = stat[close + 1..].split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, parent, stat[open + 1..close].to_owned()))
        })
        .collect()
}

/// The nearest descendant of `ancestor` named `comm` (breadth first), and the pids from
/// `ancestor` down to it.
fn descendant_named(ancestor: u32, comm: &str) -> Option<(u32, Vec<u32>)> {
    let procs = processes();
    let mut level = vec![vec![ancestor]];
    for _ in 0..8 {
        let mut next = Vec::new();
        for path in level {
            let last = *path.last().expect("non-empty");
            for (pid, _, name) in procs.iter().filter(|(_, ppid, _)| *ppid == last) {
                let mut p = path.clone();
                p.push(*pid);
                if name == comm {
                    return Some((*pid, p));
                }
                next.push(p);
            }
        }
        level = next;
    }
    None
}

/// The pid of host process `pid` in its own pid namespace (last field of `NSpid`).
fn namespace_pid(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("NSpid:")?.split_whitespace().last()?.parse().ok()))
        .unwrap_or_else(|| panic!("NSpid of {pid}"))
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        // Debian 13: SIGKILL to the namespace's pid 1 takes every process of the namespace down,
        // and `unshare` exits once it is gone (the first child, waited for below).
        if let Some(init) = self.chroot.as_ref().and_then(|c| c.init) {
            let _ = Command::new("kill").arg("-KILL").arg(init.to_string()).status();
        }
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.chroot.is_some() {
            let _ = crate::wait_for(Duration::from_secs(5), || {
                self.pids.iter().all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()).then_some(())
            });
        }
        if let Some(chroot) = &self.chroot {
            let _ = std::fs::remove_dir_all(host_path(&chroot.root, &chroot.inner));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A minimal HTTP configuration: frontend `fe_main` on `front_port`, backend `be_app` with one
/// server per address, and `extra` appended.
#[must_use]
pub fn config(front_port: u16, servers: &[std::net::SocketAddr], extra: &str) -> String {
    let mut cfg = format!(
        "global\n    maxconn 4096\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
         frontend fe_main\n    bind 127.0.0.1:{front_port}\n    default_backend be_app\n\nbackend be_app\n"
    );
    for (i, s) in servers.iter().enumerate() {
        let _ = writeln!(cfg, "    server s{i} {s}");
    }
    cfg.push_str(extra);
    cfg
}

/// Runs `haproxy -c` on `config` with the given version's binary (3.0 chrooted in the trixie
/// tree, without namespaces: checking starts nothing). `Err` holds its output.
///
/// # Errors
/// When `HAProxy` rejects the configuration.
pub fn check_config(version: Version, config: &str) -> Result<(), String> {
    let name = format!("check-{}", unique_comm());
    let output = match version {
        Version::Debian12 => {
            let dir = std::env::temp_dir().join(format!("tracetap-e2e-{name}"));
            std::fs::create_dir_all(&dir).expect("temp dir");
            let path = dir.join("haproxy.cfg");
            std::fs::write(&path, config).expect("write config");
            let out = Command::new(haproxy_binary()).arg("-c").arg("-f").arg(&path).output().expect("run haproxy -c");
            let _ = std::fs::remove_dir_all(&dir);
            out
        }
        Version::Debian13 => {
            let root = trixie_root();
            let inner = PathBuf::from("/").join(CHROOT_INSTANCES).join(&name);
            let host = host_path(&root, &inner);
            std::fs::create_dir_all(&host).expect("instance dir in the trixie tree");
            std::fs::write(host.join("haproxy.cfg"), config).expect("write config");
            let out = Command::new("chroot")
                .arg(&root)
                .args(["/usr/sbin/haproxy", "-c", "-f"])
                .arg(inner.join("haproxy.cfg"))
                .output()
                .expect("run haproxy -c in the trixie tree");
            let _ = std::fs::remove_dir_all(&host);
            out
        }
    };
    if output.status.success() {
        Ok(())
    } else {
        Err(format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
    }
}
