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
mod hosts;
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
mod tests;
