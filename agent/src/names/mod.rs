//! Names from each traced HAProxy's own configuration: the `-f` files (and directories) on its
//! command line, read through `/proc/PID/root` so it works for HAProxy in containers (or, for a
//! process that `chroot`ed itself, the root it started in above its jail: [`crate::procfs::root::start_root`]). A config that
//! cannot be read or understood degrades spans to addresses, with one warning per process.
//!
//! Those files are hostile input: any process named `haproxy` chooses them, and may point `-f` at a
//! FIFO, `/dev/zero`, a huge file, a symbolic link loop, a directory of junk, or a file on a FUSE
//! or NFS mount that never answers. So:
//!
//! - Nothing is read on the capture thread. [`Names::of`] never waits: the first time a process
//!   is asked about (or [`Names::refresh`] sees it among the targets, which is sooner), its load is
//!   handed to a loader thread, and `of` returns `None` until the names arrive. The trade-off:
//!   the connections a new HAProxy process handles before that (its first housekeeping tick,
//!   250 ms at most, plus the time to read its files) get spans named by addresses, and if they
//!   belong to a `mode tcp` section they are parsed as HTTP (most likely counted as opaque, or
//!   traced if their bytes look like HTTP) instead of ignored. What it buys: a file whose read
//!   blocks costs a loader thread, never the capture thread, so it can neither stall capture nor
//!   fill the ring buffer.
//! - At most [`MAX_LOADERS`] loads run at once, each in its own short-lived thread. A load that
//!   has not answered within [`LOAD_TIMEOUT`] is given up (the process gets addresses, counted and
//!   warned); its thread is left to finish, or to hang, holding its slot. A process that hangs
//!   every loader thus costs at most [`MAX_LOADERS`] parked threads, and the loads after it time
//!   out instead of piling up threads.
//! - What a load reads, and its bounds, are in `config_files`; paths resolve inside the
//!   process's root as `crate::procfs::root` resolves them.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use tracetap_proxy::haproxy_config::ProxyNames;
use tracetap_proxy::haproxy_runtime::ServersState;

use crate::metrics::{self, Metrics};

mod config_files;
mod runtime_api;
mod runtime_tables;

use config_files::load;
pub use config_files::{
    MAX_CMDLINE_BYTES, MAX_CONFIG_BYTES, MAX_CONFIG_FILES, MAX_DIR_ENTRIES, MAX_ENVIRON_BYTES, MAX_HOSTS_BYTES,
    MAX_PROBLEMS_KEPT, config_paths,
};
pub use runtime_api::{RuntimeApiError, read_servers_state};
use runtime_tables::{Runtime, RuntimeReads};

/// Loads running at once.
pub const MAX_LOADERS: usize = 2;
/// A load that has not answered by then (counted from the request) is given up.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The runtime API's server table is read again this often without traffic.
pub const RUNTIME_REFRESH: Duration = Duration::from_secs(2);
/// While spans wait for a table read after their request, reads come this often (each one
/// settles every span waiting when it started)...
pub const RUNTIME_MIN_GAP: Duration = Duration::from_millis(200);
/// ...or, for a big table, at least this many times the last read's duration apart, so that
/// answering them takes HAProxy at most about 1% of a CPU (measured: 4 200 servers, the HAProxy
/// Kubernetes Ingress Controller's 42 slots in 100 backends, cost HAProxy 2.2 ms a read).
pub const RUNTIME_GAP_PER_READ_TIME: u32 = 100;
/// ...but never more than this apart while spans wait (they wait at most 3 s): past some 40 000
/// servers, the reads cost HAProxy more than 1%.
pub const RUNTIME_MAX_GAP: Duration = Duration::from_secs(1);
/// After a failed read, the next one comes this much later.
pub const RUNTIME_RETRY: Duration = Duration::from_secs(10);
/// A read that has not answered by then is given up (on the reading thread).
pub const RUNTIME_TIMEOUT: Duration = Duration::from_secs(2);
/// Runtime API reads running at once (a process whose socket hangs holds one until the timeout).
pub const MAX_RUNTIME_READS: usize = 2;
/// How long the state of a process that is not (or no longer) a target is kept: events may name
/// a process before discovery sees it, and one that exits before then is never forgotten otherwise.
const FORGET_AFTER: Duration = Duration::from_secs(10);

/// See [`Names::settled_at`].
#[derive(Debug)]
pub enum NamesAt {
    Ready(Option<Arc<ProxyNames>>),
    Wait,
}

/// Reads the configuration of a process (`load`, or a stand-in in tests).
type Loader = fn(&Path, u32) -> Outcome;
/// Reads a process's server table from one of its stats sockets ([`read_servers_state`], or a
/// stand-in in tests).
/// Reads one process's server table: `(proc root, pid, socket path, its chroot directive, timeout)`.
type RuntimeReader = fn(&Path, u32, &str, Option<&str>, Duration) -> Result<ServersState, RuntimeApiError>;

/// Per-process names, loaded in the background.
#[derive(Debug)]
pub struct Names {
    proc_root: PathBuf,
    by_pid: HashMap<u32, State>,
    /// Loads asked for and not started yet, in order (some may be stale: checked when started).
    waiting: VecDeque<(u32, u64)>,
    /// Loader threads started that have not reported back (hung ones included).
    running: usize,
    next_id: u64,
    sender: Sender<Loaded>,
    results: Receiver<Loaded>,
    read_errors: u64,
    loader: Loader,
    timeout: Duration,
    /// The runtime API's server tables (`TRACETAP_HAPROXY_RUNTIME_API`).
    runtime: RuntimeReads,
}

#[derive(Debug)]
enum State {
    /// Load `id` asked for at `since`.
    Pending { id: u64, since: Instant },
    /// Loaded (`None`: nothing could be read), at `since`.
    Done { names: Option<Arc<ProxyNames>>, runtime: Runtime, since: Instant },
}

impl State {
    fn since(&self) -> Instant {
        match self {
            Self::Pending { since, .. } | Self::Done { since, .. } => *since,
        }
    }
}

#[derive(Debug)]
struct Loaded {
    pid: u32,
    id: u64,
    outcome: Outcome,
}

/// What one load found.
#[derive(Debug, Default)]
pub struct Outcome {
    /// `None` when no file at all could be read.
    pub names: Option<ProxyNames>,
    /// The first [`MAX_PROBLEMS_KEPT`] files (or steps before the files) that could not be read:
    /// what and why.
    pub problems: Vec<String>,
    /// How many there were in all.
    pub problem_count: usize,
}

impl Outcome {
    fn failed(problem: String) -> Self {
        Self { names: None, problems: vec![problem], problem_count: 1 }
    }
}

impl Names {
    #[must_use]
    pub fn new(proc_root: &Path, runtime_api: bool) -> Self {
        let mut names = Self::with_loader(proc_root, load, LOAD_TIMEOUT);
        names.runtime.enabled = runtime_api;
        names
    }

    fn with_loader(proc_root: &Path, loader: Loader, timeout: Duration) -> Self {
        let (sender, results) = mpsc::channel();
        Self {
            proc_root: proc_root.to_owned(),
            by_pid: HashMap::new(),
            waiting: VecDeque::new(),
            running: 0,
            next_id: 0,
            sender,
            results,
            read_errors: 0,
            loader,
            timeout,
            runtime: RuntimeReads::new(read_servers_state),
        }
    }

    /// The names of process `pid`'s configuration, once loaded and if it could be read. Never
    /// waits: `None` while the load runs (which this starts if nothing asked for it yet).
    pub fn of(&mut self, pid: u32) -> Option<Arc<ProxyNames>> {
        match self.by_pid.get(&pid) {
            Some(State::Done { .. }) => {}
            Some(State::Pending { .. }) => self.poll(),
            None => {
                self.request(pid);
                self.poll();
            }
        }
        match self.by_pid.get(&pid) {
            Some(State::Done { names, runtime, .. }) => match &runtime.current {
                // The runtime API's newest table; its names are dated per address
                // (`ProxyNames::server_for_sent` says what held when).
                Some((_, current)) => Some(current.clone()),
                None => names.clone(),
            },
            _ => None,
        }
    }

    /// The names for a span whose server names cannot be known (its wait for a table read ran
    /// out, or the agent stops): without servers where the runtime API is in use, else as
    /// [`Names::of`].
    pub fn unsettled(&mut self, pid: u32) -> Option<Arc<ProxyNames>> {
        let runtime_api = self.runtime.enabled;
        match self.by_pid.get_mut(&pid) {
            Some(State::Done { names: Some(names), runtime, .. }) if runtime.in_use(runtime_api, names) => {
                Some(runtime.no_servers.get_or_insert_with(|| Arc::new(names.without_servers())).clone())
            }
            _ => self.of(pid),
        }
    }

    /// The names for spans of a request process `pid` sent at `sent_ns`, or [`NamesAt::Wait`] while
    /// the runtime API is in use for it and no table read since then has come in: a span reports
    /// the names true when its request was sent, and only a read that started after that can
    /// say. Waiting asks for a read (at most every [`RUNTIME_MIN_GAP`], started by [`Names::tick`]).
    /// Never waits itself.
    pub fn settled_at(&mut self, pid: u32, sent_ns: u64) -> NamesAt {
        let runtime_api = self.runtime.enabled;
        if let Some(State::Done { names: Some(names), runtime, .. }) = self.by_pid.get_mut(&pid)
            && runtime.in_use(runtime_api, names)
        {
            if runtime.failing {
                // Tables were read, and changes since cannot be known: no server names. Never
                // read: the configuration's, as without a runtime API.
                if runtime.current.is_some() {
                    return NamesAt::Ready(self.unsettled(pid));
                }
            } else if runtime.current.as_ref().is_none_or(|(from, _)| *from <= sent_ns) {
                runtime.wanted = true;
                return NamesAt::Wait;
            }
        }
        NamesAt::Ready(self.of(pid))
    }

    /// Changes each time a runtime API read comes in: waiting spans need a look only then.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.runtime.generation()
    }

    /// Starts the runtime API reads that are due and takes in those that finished (see
    /// [`Names::settled_at`]). Call it often (every pass of the capture loop); it never blocks.
    pub fn tick(&mut self, now_ns: u64) {
        self.runtime.take_finished(&mut self.by_pid);
        self.runtime.start_due(&mut self.by_pid, &self.proc_root, now_ns);
    }

    /// Housekeeping: asks for the names of new targets, collects finished loads, gives up on late
    /// ones, forgets what is no longer needed and publishes the error count.
    pub fn refresh(&mut self, targets: &BTreeSet<u32>, metrics: &Metrics, now_ns: u64) {
        for &pid in targets {
            if !self.by_pid.contains_key(&pid) {
                self.request(pid);
            }
        }
        self.poll();
        let now = Instant::now();
        let late: Vec<u32> = self
            .by_pid
            .iter()
            .filter(|(_, s)| matches!(s, State::Pending { since, .. } if now.duration_since(*since) >= self.timeout))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in late {
            let why = if self.running >= MAX_LOADERS {
                "every loader thread is still busy (a file that blocks?)"
            } else {
                "reading it did not finish (a file that blocks?)"
            };
            self.finish(pid, Outcome::failed(format!("no answer within {:?}: {why}", self.timeout)));
        }
        self.by_pid.retain(|pid, s| targets.contains(pid) || now.duration_since(s.since()) < FORGET_AFTER);
        let by_pid = &self.by_pid;
        self.waiting.retain(|(pid, id)| matches!(by_pid.get(pid), Some(State::Pending { id: i, .. }) if i == id));
        self.runtime.take_finished(&mut self.by_pid);
        self.runtime.start_due(&mut self.by_pid, &self.proc_root, now_ns);
        metrics::set(&metrics.config_read_errors, self.read_errors);
        metrics::set(&metrics.runtime_api_reads, self.runtime.reads);
        metrics::set(&metrics.runtime_api_errors, self.runtime.errors);
    }

    /// True when the names of at least one of `targets` are in, or known to be unavailable.
    /// Readiness waits for it: the connections made after `/readyz` answers are then named and
    /// their mode known (one housekeeping tick later than the probes alone would be ready).
    #[must_use]
    pub fn any_settled(&self, targets: &BTreeSet<u32>) -> bool {
        targets.iter().any(|pid| matches!(self.by_pid.get(pid), Some(State::Done { .. })))
    }

    /// Files (or command lines) that could not be read, since the start.
    #[must_use]
    pub fn read_errors(&self) -> u64 {
        self.read_errors
    }

    /// A process exited: its names are kept for [`FORGET_AFTER`] more (spans of its last
    /// requests may still wait for them), then dropped by [`Names::refresh`].
    pub fn forget_process(&mut self, pid: u32) {
        match self.by_pid.get_mut(&pid) {
            Some(State::Done { since, runtime, .. }) => {
                *since = Instant::now();
                // Nothing answers for it any more.
                runtime.superseded = true;
            }
            Some(State::Pending { .. }) => {
                self.by_pid.remove(&pid);
            }
            None => {}
        }
    }

    fn request(&mut self, pid: u32) {
        let id = self.next_id;
        self.next_id += 1;
        self.by_pid.insert(pid, State::Pending { id, since: Instant::now() });
        self.waiting.push_back((pid, id));
    }

    /// Collects finished loads and starts waiting ones while a loader is free. Never blocks.
    fn poll(&mut self) {
        while let Ok(loaded) = self.results.try_recv() {
            self.running -= 1;
            if matches!(self.by_pid.get(&loaded.pid), Some(State::Pending { id, .. }) if *id == loaded.id) {
                self.finish(loaded.pid, loaded.outcome);
            }
        }
        while self.running < MAX_LOADERS
            && let Some((pid, id)) = self.waiting.pop_front()
        {
            if matches!(self.by_pid.get(&pid), Some(State::Pending { id: i, .. }) if *i == id) {
                self.start(pid, id);
            }
        }
    }

    fn start(&mut self, pid: u32, id: u64) {
        let (root, sender, loader) = (self.proc_root.clone(), self.sender.clone(), self.loader);
        let spawned = std::thread::Builder::new().name("names".into()).spawn(move || {
            let outcome = loader(&root, pid);
            // The receiver is gone when the capture thread has returned: nothing left to do.
            let _ = sender.send(Loaded { pid, id, outcome });
        });
        match spawned {
            // Detached: a hung load is never joined.
            Ok(_) => self.running += 1,
            Err(e) => self.finish(pid, Outcome::failed(format!("cannot start a loader thread: {e}"))),
        }
    }

    fn finish(&mut self, pid: u32, outcome: Outcome) {
        let Outcome { names, problems, problem_count } = outcome;
        self.read_errors += problem_count as u64;
        let (skipped, skipped_lines, over_limit_lines) =
            names.as_ref().map_or((&[][..], 0, 0), |n| (&n.skipped[..], n.skipped_lines, n.over_limit_lines));
        if names.is_none() {
            tracing::warn!(
                pid,
                ?problems,
                problem_count,
                "cannot read the HAProxy configuration; spans carry addresses instead of frontend/backend names"
            );
        } else if problem_count > 0 || skipped_lines > 0 || over_limit_lines > 0 {
            tracing::warn!(
                pid,
                ?problems,
                problem_count,
                ?skipped,
                skipped_lines,
                over_limit_lines,
                "parts of the HAProxy configuration could not be read; the spans they would name carry addresses only"
            );
        }
        self.by_pid.insert(
            pid,
            State::Done { names: names.map(Arc::new), runtime: Runtime::default(), since: Instant::now() },
        );
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;

    #[test]
    fn command_line_config_paths() {
        assert_eq!(
            config_paths(b"haproxy\0-f\0/etc/haproxy/haproxy.cfg\0-f\0conf.d\0-p\0/run/h.pid\0"),
            vec!["/etc/haproxy/haproxy.cfg", "conf.d"]
        );
        assert_eq!(config_paths(b"haproxy\0-f/etc/a.cfg\0-Ws\0"), vec!["/etc/a.cfg"]);
        assert!(config_paths(b"haproxy\0-f").is_empty());
        assert_eq!(
            config_paths(b"haproxy\0-W\0-f\0/etc/a.cfg\0--\0/etc/b.cfg\0-f\0"),
            vec!["/etc/a.cfg", "/etc/b.cfg", "-f"],
            "after `--` every argument is a file, in order"
        );
    }

    /// A fake `/proc` with process 7 whose root is `root` (a directory of the test, or `/`) and
    /// whose command line gives `args` after `-f`.
    struct FakeProc {
        dir: tempfile::TempDir,
    }

    const PID: u32 = 7;

    impl FakeProc {
        fn new(root: Option<&Path>, cwd: &str, args: &[&str]) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let pid_dir = dir.path().join("proc").join(PID.to_string());
            std::fs::create_dir_all(&pid_dir).unwrap();
            std::fs::create_dir(dir.path().join("rootfs")).unwrap();
            let root = root.map_or_else(|| dir.path().join("rootfs"), Path::to_owned);
            std::os::unix::fs::symlink(root, pid_dir.join("root")).unwrap();
            std::os::unix::fs::symlink(cwd, pid_dir.join("cwd")).unwrap();
            let mut cmdline = b"haproxy\0-W\0".to_vec();
            for a in args {
                cmdline.extend_from_slice(b"-f\0");
                cmdline.extend_from_slice(a.as_bytes());
                cmdline.push(0);
            }
            std::fs::write(pid_dir.join("cmdline"), cmdline).unwrap();
            Self { dir }
        }

        fn proc_root(&self) -> PathBuf {
            self.dir.path().join("proc")
        }

        fn rootfs(&self, name: &str) -> PathBuf {
            self.dir.path().join("rootfs").join(name)
        }

        fn load(&self) -> Outcome {
            load_within_10s(self.proc_root(), PID)
        }
    }

    /// Loads in a thread; fails the test if the load has not returned within 10 s (a liveness
    /// check: every case here returns in milliseconds, a hang never does).
    fn load_within_10s(proc_root: PathBuf, pid: u32) -> Outcome {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(load(&proc_root, pid));
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("the load hung")
    }

    fn mkfifo(path: &Path) {
        assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
    }

    const FE: &str = "frontend fe_good\n bind 127.0.0.1:7001\n";

    fn loaded_good(outcome: &Outcome) -> bool {
        outcome.names.as_ref().is_some_and(|n| n.frontend("127.0.0.1:7001".parse().unwrap()) == Some("fe_good"))
    }

    fn problem_about(outcome: &Outcome, what: &str, why: &str) -> bool {
        outcome.problems.iter().any(|p| p.contains(what) && p.contains(why))
    }

    /// HAProxy's `chroot`: `/proc/PID/root` is the jail, the configuration is where the process
    /// started, above it, and used only when its `chroot` is that jail; a configuration in the
    /// jail itself wins.
    #[test]
    fn a_process_in_its_chroot_jail_is_read_from_the_root_it_started_in() {
        let tree = tempfile::tempdir().unwrap();
        let jail = tree.path().join("var/lib/haproxy");
        std::fs::create_dir_all(&jail).unwrap();
        std::fs::create_dir_all(tree.path().join("etc/haproxy")).unwrap();
        let cfg = tree.path().join("etc/haproxy/haproxy.cfg");
        std::fs::write(&cfg, format!("global\n chroot /var/lib/haproxy\n{FE}")).unwrap();
        let proc = FakeProc::new(Some(&jail), "/", &["/etc/haproxy/haproxy.cfg"]);
        assert!(loaded_good(&proc.load()), "read from three directories above the jail");

        // Confined by someone else: the file above is not the process's, whatever it says.
        std::fs::write(&cfg, format!("global\n chroot /somewhere/else\n{FE}")).unwrap();
        let outcome = proc.load();
        assert!(outcome.names.is_none(), "a chroot that is not the process's root: not used");
        assert!(problem_about(&outcome, "haproxy.cfg", "names no `chroot`"), "{:?}", outcome.problems);
        std::fs::write(&cfg, FE).unwrap();
        assert!(proc.load().names.is_none(), "no chroot at all: not used");

        std::fs::create_dir_all(jail.join("etc/haproxy")).unwrap();
        std::fs::write(jail.join("etc/haproxy/haproxy.cfg"), "frontend fe_jail\n bind 127.0.0.1:7001\n").unwrap();
        let names = proc.load().names.expect("names");
        assert_eq!(names.frontend("127.0.0.1:7001".parse().unwrap()), Some("fe_jail"), "the process's own root first");
    }

    #[test]
    fn hostile_files_fail_promptly_and_regular_files_still_load() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.cfg");
        std::fs::write(&good, FE).unwrap();
        let fifo = dir.path().join("fifo.cfg");
        mkfifo(&fifo);
        let big = dir.path().join("big.cfg");
        File::create(&big).unwrap().set_len(MAX_CONFIG_BYTES + 1).unwrap();
        let zero_link = dir.path().join("zero.cfg");
        std::os::unix::fs::symlink("/dev/zero", &zero_link).unwrap();
        let (loop_a, loop_b) = (dir.path().join("a.cfg"), dir.path().join("b.cfg"));
        std::os::unix::fs::symlink(&loop_b, &loop_a).unwrap();
        std::os::unix::fs::symlink(&loop_a, &loop_b).unwrap();
        let cases: [(&Path, &str); 5] = [
            (&fifo, "a FIFO"),
            (&big, "cap"),
            (Path::new("/dev/zero"), "a character device"),
            (&zero_link, "a character device"),
            (&loop_a, "symbolic links"),
        ];
        for (bad, why) in cases {
            let bad_arg = bad.to_str().unwrap();
            let proc = FakeProc::new(Some(Path::new("/")), "/", &[bad_arg, good.to_str().unwrap()]);
            let outcome = proc.load();
            assert!(problem_about(&outcome, bad_arg, why), "{bad_arg}: {:?}", outcome.problems);
            assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
            assert!(loaded_good(&outcome), "{bad_arg}: the regular file still loads");
            let alone = FakeProc::new(Some(Path::new("/")), "/", &[bad_arg]).load();
            assert!(alone.names.is_none() && problem_about(&alone, bad_arg, why), "{bad_arg}: {:?}", alone.problems);
        }
    }

    #[test]
    fn a_directory_with_a_fifo_loads_its_regular_files() {
        let proc = FakeProc::new(None, "/etc/haproxy", &["conf.d"]);
        let conf = proc.rootfs("etc/haproxy/conf.d");
        std::fs::create_dir_all(&conf).unwrap();
        std::fs::write(conf.join("00-defaults.cfg"), "defaults\n mode http\n").unwrap();
        std::fs::write(conf.join("10-fe.cfg"), FE).unwrap();
        mkfifo(&conf.join("20-fifo.cfg"));
        std::fs::write(conf.join("30-be.cfg"), "backend be_x\n server s1 127.0.0.1:7002\n").unwrap();
        std::fs::write(conf.join("ignored.txt"), "frontend nope\n bind :1\n").unwrap();
        std::os::unix::fs::symlink("/dev/zero", conf.join("40-zero.cfg")).unwrap();
        let outcome = proc.load();
        assert!(loaded_good(&outcome));
        let names = outcome.names.unwrap();
        assert!(!names.bind("127.0.0.1:7001".parse().unwrap()).unwrap().tcp, "defaults from an earlier file");
        assert_eq!(names.server("127.0.0.1:7002".parse().unwrap()), Some(("be_x", "s1")));
        assert_eq!(names.frontend("127.0.0.1:1".parse().unwrap()), None);
        assert_eq!(outcome.problems.len(), 2, "{:?}", outcome.problems);
        assert!(outcome.problems.iter().any(|p| p.contains("20-fifo.cfg") && p.contains("a FIFO")));
        // Inside this root there is no /dev/zero: the absolute link resolves in the root.
        assert!(outcome.problems.iter().any(|p| p.contains("40-zero.cfg") && p.contains("No such file")));
    }

    #[test]
    fn paths_and_links_stay_inside_the_process_root() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.cfg"), "frontend secret\n bind :9\n").unwrap();
        let escape = format!("../../../../../../../../..{}/secret.cfg", outside.path().display());
        let proc = FakeProc::new(None, "/etc", &[&escape, "/etc/link.cfg", "/etc/rel.cfg"]);
        std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
        std::fs::create_dir_all(proc.rootfs(outside.path().strip_prefix("/").unwrap().to_str().unwrap())).unwrap();
        std::fs::write(
            proc.rootfs(&format!("{}/secret.cfg", outside.path().strip_prefix("/").unwrap().display())),
            "frontend inside\n bind :9\n",
        )
        .unwrap();
        std::fs::write(proc.rootfs("etc/real.cfg"), FE).unwrap();
        std::os::unix::fs::symlink("/etc/real.cfg", proc.rootfs("etc/link.cfg")).unwrap();
        std::os::unix::fs::symlink("../../../etc/./real.cfg", proc.rootfs("etc/rel.cfg")).unwrap();
        let outcome = proc.load();
        assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
        let names = outcome.names.unwrap();
        assert_eq!(names.frontend("127.0.0.1:9".parse().unwrap()), Some("inside"), "`..` stops at the root");
        assert_eq!(names.frontends.len(), 3, "both links lead to the file inside the root");
    }

    #[test]
    fn directories_files_and_bytes_are_capped() {
        let dir = tempfile::tempdir().unwrap();
        let crowded = dir.path().join("crowded");
        std::fs::create_dir(&crowded).unwrap();
        for i in 0..=MAX_DIR_ENTRIES {
            std::fs::write(crowded.join(format!("{i}.junk")), "").unwrap();
        }
        let outcome = FakeProc::new(Some(Path::new("/")), "/", &[crowded.to_str().unwrap()]).load();
        assert!(problem_about(&outcome, "crowded", "entries") && outcome.problems.len() == 1, "{:?}", outcome.problems);

        // The directory is one of the paths opened: it leaves room for MAX_CONFIG_FILES - 1 files.
        let many = dir.path().join("many");
        std::fs::create_dir(&many).unwrap();
        for i in 0..MAX_CONFIG_FILES {
            std::fs::write(many.join(format!("{i:04}.cfg")), if i == 0 { FE } else { "" }).unwrap();
        }
        let outcome = FakeProc::new(Some(Path::new("/")), "/", &[many.to_str().unwrap()]).load();
        let last = format!("{:04}.cfg", MAX_CONFIG_FILES - 1);
        assert!(problem_about(&outcome, &last, "files"), "{:?}", outcome.problems);
        assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
        assert!(loaded_good(&outcome));
        let zeros = vec!["/dev/zero"; 10 * MAX_CONFIG_FILES];
        let outcome = FakeProc::new(Some(Path::new("/")), "/", &zeros).load();
        assert_eq!(outcome.problem_count, zeros.len(), "every argument is a problem");
        assert_eq!(outcome.problems.len(), MAX_PROBLEMS_KEPT, "a few are kept for the warning");
        assert!(outcome.problems.iter().all(|p| p.contains("character device")), "the first ones");

        let half = dir.path().join("half.cfg");
        File::create(&half).unwrap().set_len(MAX_CONFIG_BYTES / 2 + 1).unwrap();
        let good = dir.path().join("good.cfg");
        std::fs::write(&good, FE).unwrap();
        let (half, good) = (half.to_str().unwrap(), good.to_str().unwrap());
        let outcome = FakeProc::new(Some(Path::new("/")), "/", &[half, half, good]).load();
        assert!(problem_about(&outcome, "half.cfg", "cap"), "the total is capped: {:?}", outcome.problems);
        assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
        assert!(loaded_good(&outcome));
    }

    #[test]
    fn unreadable_process_and_missing_arguments() {
        let none = FakeProc::new(None, "/", &[]).load();
        assert!(none.names.is_none() && none.problems[0].contains("no -f"));
        let gone = FakeProc::new(None, "/", &["/x.cfg"]);
        let outcome = load_within_10s(gone.proc_root(), PID + 1);
        assert!(outcome.names.is_none() && outcome.problems[0].contains("cmdline"));
    }

    #[test]
    fn reads_a_real_process_through_proc() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("h.cfg"), FE).unwrap();
        // `sh -c SCRIPT -f FILE`: the command line has `-f FILE`, and the `:` keeps sh from
        // replacing itself with sleep.
        let mut child =
            Command::new("sh").args(["-c", "sleep 30; :", "-f", "h.cfg"]).current_dir(dir.path()).spawn().unwrap();
        // Until the child has exec'd, /proc/PID/cmdline is still the test binary's.
        let cmdline = PathBuf::from(format!("/proc/{}/cmdline", child.id()));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(&cmdline).is_ok_and(|c| c.windows(4).any(|w| w == b"\0-f\0")) && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let outcome = load_within_10s(PathBuf::from("/proc"), child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
        assert!(loaded_good(&outcome), "relative to the process's cwd, through /proc/PID/root");
    }

    fn wait_for(names: &mut Names, pid: u32) -> Option<Arc<ProxyNames>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(n) = names.of(pid) {
                return Some(n);
            }
            if matches!(names.by_pid.get(&pid), Some(State::Done { .. })) || Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn names_arrive_in_the_background() {
        let proc = FakeProc::new(None, "/", &["/etc/h.cfg", "/missing.cfg"]);
        std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
        std::fs::write(proc.rootfs("etc/h.cfg"), FE).unwrap();
        let mut names = Names::new(&proc.proc_root(), false);
        let metrics = Metrics::default();
        names.refresh(&BTreeSet::from([PID]), &metrics, 0);
        assert!(!names.any_settled(&BTreeSet::from([PID])));
        let got = wait_for(&mut names, PID).expect("names arrive");
        assert!(names.any_settled(&BTreeSet::from([PID])));
        assert_eq!(got.frontend("127.0.0.1:7001".parse().unwrap()), Some("fe_good"));
        names.refresh(&BTreeSet::from([PID]), &metrics, 0);
        assert_eq!(metrics.config_read_errors.load(std::sync::atomic::Ordering::Relaxed), 1, "the missing file");
        names.forget_process(PID);
        assert!(names.of(PID).is_some(), "kept a while for the spans of its last requests");
        names.refresh(&BTreeSet::new(), &metrics, 0);
        assert!(names.by_pid.contains_key(&PID), "not a target any more, forgotten only after FORGET_AFTER");
    }

    static TABLES_READ: AtomicUsize = AtomicUsize::new(0);

    /// A runtime API that answers two tables, then refuses: first `SRV_1` at :9001; then `SRV_1`
    /// emptied and `SRV_2` at :9001 (a slot moved, as on a pod restart); then permission denied.
    fn scripted_runtime(
        _: &Path,
        _: u32,
        path: &str,
        _: Option<&str>,
        _: Duration,
    ) -> Result<ServersState, RuntimeApiError> {
        assert_eq!(path, "/run/admin.sock");
        let header = "1\n# be_name srv_name srv_addr srv_port srv_admin_state\n";
        match TABLES_READ.fetch_add(1, SeqCst) {
            0 => Ok(tracetap_proxy::haproxy_runtime::parse_servers_state(&format!(
                "{header}be SRV_1 127.0.0.1 9001 0\nbe SRV_2 127.0.0.1 1 4\n"
            ))
            .unwrap()),
            1 => Ok(tracetap_proxy::haproxy_runtime::parse_servers_state(&format!(
                "{header}be SRV_1 127.0.0.1 1 4\nbe SRV_2 127.0.0.1 9001 0\n"
            ))
            .unwrap()),
            _ => Err(RuntimeApiError::Denied {
                path: path.to_owned(),
                source: io::Error::from(io::ErrorKind::PermissionDenied),
            }),
        }
    }

    #[test]
    fn runtime_tables_name_servers_as_they_were_when_sent_and_failures_fall_back() {
        use tracetap_proxy::haproxy_config::ServerMatch;
        let proc = FakeProc::new(None, "/", &["/etc/h.cfg"]);
        std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
        std::fs::write(
            proc.rootfs("etc/h.cfg"),
            "global\n    stats socket /run/admin.sock mode 600 level admin\n\
             frontend f\n    bind 127.0.0.1:7001\n    default_backend be\n\
             backend be\n    server-template SRV_ 2 127.0.0.1:1 disabled\n",
        )
        .unwrap();
        let mut names = {
            let mut names = Names::new(&proc.proc_root(), true);
            names.runtime.reader = scripted_runtime;
            names
        };
        let metrics = Metrics::default();
        let pids = BTreeSet::from([PID]);
        let app: std::net::SocketAddr = "127.0.0.1:9001".parse().unwrap();
        let server =
            |n: &Option<Arc<ProxyNames>>, sent: u64| match n.as_ref().unwrap().server_for_sent(app, Some("f"), sent) {
                ServerMatch::Named { server, .. } => Some(server.to_owned()),
                ServerMatch::Ambiguous => Some("ambiguous".to_owned()),
                ServerMatch::Unknown => None,
            };
        // Waits (ticking at `now_ns`) until the names for a request sent at `sent` are settled.
        let settled = |names: &mut Names, sent: u64, now_ns: u64| {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                names.tick(now_ns);
                if let NamesAt::Ready(n) = names.settled_at(PID, sent) {
                    return server(&n, sent);
                }
                assert!(Instant::now() < deadline, "settled in time");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        names.refresh(&pids, &metrics, 1_000);
        assert!(wait_for(&mut names, PID).is_some());
        assert!(matches!(names.settled_at(PID, 1_500), NamesAt::Wait), "the first table is not read yet");
        assert_eq!(server(&names.of(PID), 1_500), None, "the configuration alone does not know :9001");
        assert_eq!(
            settled(&mut names, 1_500, 2_000),
            Some("SRV_1".into()),
            "the read started after the request; the address is new, so the request went there under this name"
        );
        assert_eq!(names.runtime.reads, 1);
        // A request sent after that read waits for the next one, which sees the slot moved.
        assert!(matches!(names.settled_at(PID, 2_500), NamesAt::Wait));
        assert_eq!(
            settled(&mut names, 2_500, 3_000),
            Some("ambiguous".into()),
            "moved between the reads: either, so neither"
        );
        assert_eq!(names.runtime.reads, 2, "read again after {RUNTIME_MIN_GAP:?}, not {RUNTIME_REFRESH:?}");
        assert_eq!(server(&names.of(PID), 3_000), Some("SRV_2".into()), "after the move");
        assert_eq!(server(&names.of(PID), 1_500), Some("ambiguous".into()), "a slow request sent before it");
        // A refused read after tables were read: no server names (what changed since cannot be
        // known), at once, counted.
        assert_eq!(settled(&mut names, 3_500, 4_000), None);
        assert_eq!(names.runtime.errors, 1);
        assert!(matches!(names.settled_at(PID, 5_000), NamesAt::Ready(_)), "no waiting for a refusing socket");
        names.refresh(&pids, &metrics, 4_000);
        assert_eq!(metrics.runtime_api_errors.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(metrics.runtime_api_reads.load(std::sync::atomic::Ordering::Relaxed), 2);
    }

    static RELEASE: AtomicUsize = AtomicUsize::new(0);
    static STARTED: AtomicUsize = AtomicUsize::new(0);

    /// A load that hangs until the test lets it go (a FUSE file that never answers).
    fn hanging(_: &Path, _: u32) -> Outcome {
        STARTED.fetch_add(1, SeqCst);
        while RELEASE.load(SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        Outcome { names: Some(ProxyNames::default()), ..Outcome::default() }
    }

    #[test]
    fn hung_loads_never_block_and_hold_at_most_the_loader_slots() {
        let mut names = Names::with_loader(Path::new("/nonexistent"), hanging, Duration::from_millis(200));
        let metrics = Metrics::default();
        let pids: BTreeSet<u32> = (1..=5).collect();
        let started = Instant::now();
        for pid in &pids {
            assert!(names.of(*pid).is_none());
        }
        names.refresh(&pids, &metrics, 0);
        assert!(started.elapsed() < Duration::from_secs(5), "asking never waits for a load");
        while STARTED.load(SeqCst) < MAX_LOADERS {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(250));
        names.refresh(&pids, &metrics, 0);
        assert_eq!(STARTED.load(SeqCst), MAX_LOADERS, "no more threads than loader slots");
        assert_eq!(names.running, MAX_LOADERS);
        for pid in &pids {
            assert!(names.of(*pid).is_none());
            assert!(matches!(names.by_pid[pid], State::Done { names: None, .. }), "given up after the timeout");
        }
        assert_eq!(metrics.config_read_errors.load(std::sync::atomic::Ordering::Relaxed), 5);
        // A late answer frees its slot and is not taken for a process it no longer belongs to.
        RELEASE.store(1, SeqCst);
        let deadline = Instant::now() + Duration::from_secs(10);
        while names.running > 0 && Instant::now() < deadline {
            names.poll();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(names.running, 0);
        assert!(names.of(1).is_none(), "a given-up process stays without names");
    }
}
