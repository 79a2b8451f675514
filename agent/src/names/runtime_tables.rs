//! The runtime API's server tables: when each process's table is read again (every
//! [`RUNTIME_REFRESH`], sooner when spans wait for a read, later after a failure, never more
//! often than its last read's cost allows), the reads on short-lived threads (one per process at
//! a time, at most [`MAX_RUNTIME_READS`] in all), and what a finished read changes: a new table,
//! a process superseded by a reload (its last table stays), or a failure (logged once until a read
//! succeeds). Each process's state is a [`Runtime`] inside its `State::Done`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use tracetap_proxy::haproxy_config::ProxyNames;
use tracetap_proxy::haproxy_runtime::ServersState;

use super::{
    MAX_RUNTIME_READS, RUNTIME_GAP_PER_READ_TIME, RUNTIME_MAX_GAP, RUNTIME_MIN_GAP, RUNTIME_REFRESH, RUNTIME_RETRY,
    RUNTIME_TIMEOUT, RuntimeApiError, RuntimeReader, State,
};

/// What the runtime API gave for one process.
///
/// A span reports the names that were true when its request was sent. A table read is true from
/// the moment its read started (`current.0`, monotonic ns) until the next read: so a span waits
/// for a read that started after its request ([`super::Names::settled_at`]). And the names at each
/// address hold from the start of the first read that showed them
/// (`ProxyNames::server_since`): a request sent before that (a slow one, handed out several reads
/// later) gets no name at that address, since it may have gone to the names before the change.
#[derive(Debug, Default)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent flags of one state machine (reading, superseded, wanted, failing); an enum would \
              have to spell out their combinations"
)]
pub(super) struct Runtime {
    pub(super) current: Option<(u64, Arc<ProxyNames>)>,
    /// The configuration's names without any server, for spans whose server names cannot be
    /// known (a failing socket after tables were read, a wait that ran out, shutdown).
    pub(super) no_servers: Option<Arc<ProxyNames>>,
    /// After a reload the socket path leads to the new process: this one's table no longer
    /// changes through the runtime API, and its last table stays.
    pub(super) superseded: bool,
    pub(super) reading: bool,
    /// When the last read started.
    pub(super) started: Option<Instant>,
    /// No read before this (after a failure).
    pub(super) not_before: Option<Instant>,
    /// Spans wait for a read: read again soon.
    pub(super) wanted: bool,
    /// The shortest time between reads for this process (see [`RUNTIME_GAP_PER_READ_TIME`]).
    pub(super) min_gap: Duration,
    /// The failure was logged (once, until a read succeeds again).
    pub(super) failing: bool,
}

impl Runtime {
    /// The runtime API names this process's servers: reading is on, its configuration declares a
    /// stats socket, and no newer process took the socket over.
    pub(super) fn in_use(&self, runtime_api: bool, names: &ProxyNames) -> bool {
        runtime_api && !names.stats_sockets.is_empty() && !self.superseded
    }
}

#[derive(Debug)]
struct RuntimeRead {
    pid: u32,
    started_ns: u64,
    /// How long the read took (connect to parsed answer).
    took: Duration,
    result: Result<Tables, RuntimeApiError>,
}

/// What a successful read gives, built on the reading thread (not the capture thread): the
/// names with the new table, each address's names dated against the names in use before.
#[derive(Debug)]
struct Tables {
    pub(super) current: Arc<ProxyNames>,
}

impl Tables {
    fn build(config: &ProxyNames, previous: Option<&ProxyNames>, state: &ServersState, read_ns: u64) -> Self {
        let mut current = config.with_runtime_servers(state);
        current.set_server_since(previous.unwrap_or(config), read_ns);
        Self { current: Arc::new(current) }
    }
}

/// The runtime API reads of every process.
#[derive(Debug)]
pub(super) struct RuntimeReads {
    /// Read the runtime API's server table (`TRACETAP_HAPROXY_RUNTIME_API`).
    pub(super) enabled: bool,
    pub(super) reader: RuntimeReader,
    sender: Sender<RuntimeRead>,
    results: Receiver<RuntimeRead>,
    /// Reading threads started that have not reported back.
    running: usize,
    pub(super) reads: u64,
    pub(super) errors: u64,
    /// Reads answered by another process (after a reload): not failures.
    pub(super) superseded: u64,
}

impl RuntimeReads {
    pub(super) fn new(reader: RuntimeReader) -> Self {
        let (sender, results) = mpsc::channel();
        Self { enabled: false, reader, sender, results, running: 0, reads: 0, errors: 0, superseded: 0 }
    }

    /// Changes each time a read comes in.
    pub(super) fn generation(&self) -> u64 {
        self.reads + self.errors + self.superseded
    }

    /// Starts the runtime API reads that are due: every [`RUNTIME_REFRESH`], sooner when an
    /// unknown address asked for one, later after a failure; one per process at a time and at
    /// most [`MAX_RUNTIME_READS`] in all.
    pub(super) fn start_due(&mut self, by_pid: &mut HashMap<u32, State>, proc_root: &Path, now_ns: u64) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let due: Vec<(u32, Arc<ProxyNames>, Option<Arc<ProxyNames>>)> = by_pid
            .iter()
            .filter_map(|(pid, s)| match s {
                State::Done { names: Some(names), runtime, .. }
                    if !names.stats_sockets.is_empty()
                        && !runtime.reading
                        && !runtime.superseded
                        && runtime.not_before.is_none_or(|t| now >= t)
                        && runtime.started.is_none_or(|t| {
                            let since = now.duration_since(t);
                            since >= RUNTIME_REFRESH.max(runtime.min_gap)
                                || (runtime.wanted && since >= RUNTIME_MIN_GAP.max(runtime.min_gap))
                        }) =>
                {
                    Some((*pid, names.clone(), runtime.current.as_ref().map(|(_, c)| c.clone())))
                }
                _ => None,
            })
            .collect();
        for (pid, config, previous) in due {
            if self.running >= MAX_RUNTIME_READS {
                break;
            }
            let (root, sender, reader) = (proc_root.to_owned(), self.sender.clone(), self.reader);
            let spawned = std::thread::Builder::new().name("names-runtime".into()).spawn(move || {
                // The first socket that answers; else the first one's failure. All within one
                // timeout.
                let began = Instant::now();
                let mut first_error = None;
                for path in &config.stats_sockets {
                    let left = RUNTIME_TIMEOUT.saturating_sub(began.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    match reader(&root, pid, path, config.chroot.as_deref(), left) {
                        Ok(state) => {
                            let took = began.elapsed();
                            let tables = Tables::build(&config, previous.as_deref(), &state, now_ns);
                            let _ = sender.send(RuntimeRead { pid, started_ns: now_ns, took, result: Ok(tables) });
                            return;
                        }
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                if let Some(e) = first_error {
                    let _ = sender.send(RuntimeRead { pid, started_ns: now_ns, took: began.elapsed(), result: Err(e) });
                }
            });
            if let Some(State::Done { runtime, .. }) = by_pid.get_mut(&pid) {
                runtime.started = Some(now);
                runtime.wanted = false;
                match spawned {
                    Ok(_) => {
                        runtime.reading = true;
                        self.running += 1;
                    }
                    Err(e) => {
                        tracing::warn!(pid, error = %e, "cannot start a thread to read HAProxy's runtime API");
                        runtime.not_before = Some(now + RUNTIME_RETRY);
                    }
                }
            }
        }
    }

    /// Takes in the runtime API reads that finished. Never blocks.
    pub(super) fn take_finished(&mut self, by_pid: &mut HashMap<u32, State>) {
        while let Ok(RuntimeRead { pid, started_ns, took, result }) = self.results.try_recv() {
            self.running -= 1;
            let Some(State::Done { names: Some(_), runtime, .. }) = by_pid.get_mut(&pid) else { continue };
            runtime.reading = false;
            match result {
                Ok(Tables { current }) => {
                    self.reads += 1;
                    if runtime.failing {
                        tracing::info!(pid, "HAProxy's runtime API answers again; server names follow it");
                        runtime.failing = false;
                    }
                    runtime.current = Some((started_ns, current));
                    runtime.min_gap = took.saturating_mul(RUNTIME_GAP_PER_READ_TIME).min(RUNTIME_MAX_GAP);
                }
                // The socket file went away after tables were read: a reload or an exit took it
                // (the new process binds its own), as when another process answers.
                Err(e @ RuntimeApiError::Open { .. }) if runtime.current.is_some() => {
                    self.superseded += 1;
                    tracing::debug!(pid, "{e}; keeping the last server table read for this process");
                    runtime.superseded = true;
                }
                Err(e @ RuntimeApiError::OtherProcess { .. }) => {
                    // A reload: the new process answers on the path now. This one's table stays
                    // as last read (its servers change through the new process's socket).
                    self.superseded += 1;
                    tracing::debug!(pid, "{e}; keeping the last server table read for this process");
                    runtime.superseded = true;
                }
                Err(e) => {
                    self.errors += 1;
                    if !runtime.failing {
                        tracing::warn!(
                            pid,
                            reason = e.reason(),
                            "cannot read the server table from HAProxy's runtime API: {e}"
                        );
                        runtime.failing = true;
                    }
                    // Until a read succeeds: no server names if tables were read (what changed
                    // since cannot be known), else the configuration's (`settled_at`).
                    runtime.not_before = Some(Instant::now() + RUNTIME_RETRY);
                    runtime.started = None;
                }
            }
        }
    }
}
