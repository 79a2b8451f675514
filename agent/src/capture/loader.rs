//! The agent's one place for `unsafe` and kernel plumbing: loading and attaching the probes (BTF
//! tracepoints, so tracefs is not needed), reading raw records, polling the ring buffer, and the
//! monotonic clock.
#![expect(unsafe_code, reason = "kernel interfaces: poll(2), clock_gettime(2), raw records")]

use std::os::fd::{AsFd as _, AsRawFd as _};
use std::path::Path;
use std::time::Duration;

use aya::Btf;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use std::collections::HashMap;
use std::num::NonZeroU32;

use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::{BtfTracePoint, ProgramError, UProbe};
use aya::{Ebpf, EbpfLoader};
use tracetap_ebpf_common::{
    COMM_BYTES, EventHeader, LOSS_SLOTS, TARGET_SLOTS, TLS_COOKIE_ANY_PROCESS, TargetSet, globals, maps,
};

use super::uprobes::{self, AttachWarmer, MultiPrograms, Route, TracefsEvent};
use crate::config::{Config, ProbeMode, Targets, TlsProbes, TlsRoute as TlsRouteChoice};

/// The programs of the probe object and the BTF tracepoints they attach to.
const PROGRAMS: &[(&str, &str)] = &[
    ("sys_exit", "sys_exit"),
    ("sys_enter", "sys_enter"),
    ("sched_process_exec", "sched_process_exec"),
    ("sched_process_exit", "sched_process_exit"),
];
/// Programs that return at once, on the syscall hooks (`TRACETAP_PROBE_MODE=floor`).
const FLOOR_PROGRAMS: &[(&str, &str)] = &[("sys_exit_floor", "sys_exit"), ("sys_enter_floor", "sys_enter")];

/// The runtime releases whose default seccomp profile lets `CAP_BPF` call `bpf()`.
const RUNTIMES_WITH_CAP_BPF: &str = "containerd 1.6.9 and 1.7.0 or later (containerd PR 7301), Docker Engine 23.0 or later (moby PR 43987), \
     and CRI-O 1.31 and Podman 5.2 or later (containers/common 0.60; their CAP_PERFMON case for perf_event_open, which the TLS probes use, \
     came later: containers/common issue 1988, PR 2534, merged as container-libs PR 424, first in CRI-O 1.35.1)";

/// The probe object, built by `build.rs`.
static PROBES: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracetap"));

/// Why the probes could not be started. Each message says what is missing and how to grant it.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing); tracetap needs Linux 5.17+ built with CONFIG_DEBUG_INFO_BTF"
    )]
    NoBtf,
    #[error(
        "loading the eBPF probes failed: {0}. tracetap needs root (or CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH) and Linux 5.17+ (BPF ring buffers, BTF tracepoints, bpf_loop)"
    )]
    Load(#[source] Box<aya::EbpfError>),
    /// The agent holds `CAP_BPF` yet a seccomp filter refuses `bpf()`: the container's profile
    /// predates the `CAP_BPF` case (see [`seccomp_refuses_bpf`]).
    #[error(
        "loading the eBPF probes failed: the seccomp profile of this container refused the bpf() system call although the agent holds CAP_BPF. \
         Older RuntimeDefault profiles allow bpf() and perf_event_open() only with CAP_SYS_ADMIN; \
         the CAP_BPF and CAP_PERFMON cases are in {RUNTIMES_WITH_CAP_BPF}. \
         Fix: upgrade the container runtime, or set the pod's seccompProfile to `type: Localhost, localhostProfile: profiles/tracetap.json` \
         with deploy/seccomp/tracetap.json installed on the node (docs/deploy.md says how); \
         granting CAP_SYS_ADMIN also works but gives the agent far more than it needs"
    )]
    Seccomp,
    #[error("reading the kernel's BTF (/sys/kernel/btf/vmlinux): {0}")]
    Btf(#[source] Box<aya::BtfError>),
    #[error("the probe object has no program {0}")]
    MissingProgram(String),
    #[error(
        "loading or attaching the probe program {program} failed: {source}; run as root or grant CAP_BPF and CAP_PERFMON"
    )]
    Attach { program: String, source: Box<ProgramError> },
    #[error("the probe object has no map {0}")]
    MissingMap(&'static str),
    #[error("opening map {name}: {source}")]
    Map { name: &'static str, source: Box<aya::maps::MapError> },
}

/// Loaded and attached probes, with the maps the agent uses.
pub struct Probes {
    /// Keeps programs and links alive; dropping it detaches everything.
    ebpf: Ebpf,
    pub ring: RingBuf<MapData>,
    pub losses: PerCpuArray<MapData, u64>,
    target_pids: BpfHashMap<MapData, u32, u8>,
    target_set: Array<MapData, TargetSet>,
    /// Connections whose payload the probes skip (a field of its own, so that it can be written
    /// while a ring record is borrowed).
    pub opaque: OpaqueMaps,
    /// Whether the probes judge processes by command name (then `TARGET_SET` is never complete).
    comm_filter: bool,
    /// What `TARGET_SET` holds, so that an unchanged set costs no syscall.
    target_set_written: Option<TargetSet>,
    pub attached: usize,
    /// Keeps the kernel's BPF run-time statistics on while held (`TRACETAP_PROBE_STATS`).
    _stats: Option<std::os::fd::OwnedFd>,
    /// The TLS probes attached to each process (see [`Probes::hook_tls`]).
    tls_links: HashMap<u32, Vec<TlsLink>>,
    /// The object file each hooked process's TLS probes are on.
    tls_objects: HashMap<u32, std::path::PathBuf>,
    /// Links for every process mapping a library, over a reload (see [`Probes::expect_new_workers`]).
    tls_bridges: Vec<Bridge>,
    /// Processes waiting for the plan of one of their files (see [`super::tls::PlanCache`]).
    tls_pending: std::collections::HashSet<u32>,
    /// Processes whose TLS probes could not be attached (counted once each).
    tls_refused: std::collections::HashSet<u32>,
    /// Attach plans by file, so that a new worker of a known `HAProxy` is hooked without reading
    /// its library again.
    tls_plans: super::tls::PlanCache,
    /// How the TLS probes reach the kernel here, or why they cannot (chosen at start, see
    /// [`super::uprobes`]).
    tls_route: Result<TlsRoute, String>,
    /// `TLS_HOOKED`, set once the first process is hooked.
    tls_hooked: Array<MapData, u32>,
    /// `TRACETAP_TLS_PROBES`.
    tls_placement: TlsProbes,
    /// `TRACETAP_PROBE_MODE=floor`: every TLS probe point gets a program that returns at once.
    tls_floor: bool,
}

/// The route the TLS probes take, with what it needs.
enum TlsRoute {
    /// With the warmer that keeps a new worker's first link fast, when it could be started.
    Multi(MultiPrograms, Option<AttachWarmer>),
    PerfPmu,
    Tracefs(std::path::PathBuf),
}

impl TlsRoute {
    fn route(&self) -> Route {
        match self {
            Self::Multi(..) => Route::Multi,
            Self::PerfPmu => Route::PerfPmu,
            Self::Tracefs(_) => Route::Tracefs,
        }
    }
}

/// Links of the TLS probes for every process that maps a file (device and inode), until `until`
/// (see [`Probes::expect_new_workers`]). Dropped last link first (opening probes first).
struct Bridge {
    file: (u64, u64),
    links: Vec<std::os::fd::OwnedFd>,
    until: std::time::Instant,
    /// A new process started since the bridge was made or renewed.
    settled: bool,
}

/// One attached TLS probe; the last two detach when dropped.
enum TlsLink {
    Perf(&'static str, UProbeLinkId),
    Multi(#[expect(dead_code, reason = "held for its drop, which detaches")] std::os::fd::OwnedFd),
    Tracefs(#[expect(dead_code, reason = "held for its drop, which detaches")] TracefsEvent),
}

/// What [`Probes::hook_tls`] found in a process.
#[derive(Debug)]
pub enum TlsHook {
    /// The probes are attached to the functions in this file: at their call sites, or at their
    /// entries and returns (see [`super::tls`]); `call_sites` counts the functions probed at
    /// their call site.
    Attached { object: std::path::PathBuf, call_sites: usize },
    /// No mapped file exports the TLS functions: the process does not use TLS (or links a
    /// library stripped of its symbols).
    NoLibrary,
    /// The process has its TLS probes already (hooked when it started).
    AlreadyHooked,
    /// A file of the process is being read for its plan, off the capture thread: asked again
    /// when [`Probes::retry_pending_tls`] lists it.
    Pending,
    /// The process maps a TLS library but attaching failed.
    Failed { object: std::path::PathBuf, error: String },
}

impl Probes {
    /// Loads the probes with the configured capture window and targets, and attaches the
    /// `sys_exit` and `sys_enter` raw tracepoints.
    pub fn load(config: &Config) -> Result<Self, LoadError> {
        if !Path::new("/sys/kernel/btf/vmlinux").exists() {
            return Err(LoadError::NoBtf);
        }
        // The kernel matches the command name itself, so that a new HAProxy worker is traced from
        // its first syscall. A pod selector needs the opposite: only the pids that discovery
        // selected (their pod matches), so the name filter stays off and `TARGET_PIDS` decides.
        let mut comm = [0u8; COMM_BYTES];
        if let Targets::Comm(name) = &config.targets
            && config.pod_selector.is_none()
        {
            comm[..name.len()].copy_from_slice(name.as_bytes());
        }
        let mut ebpf = EbpfLoader::new()
            .override_global(globals::CAPTURE_BYTES, &config.capture_bytes, true)
            .override_global(globals::TARGET_COMM, &comm, true)
            // Wake the agent early when the ring is an eighth full; otherwise it polls every few ms.
            .override_global(globals::WAKEUP_BYTES, &(config.ring_bytes / 8), true)
            .map_max_entries(maps::EVENTS, config.ring_bytes)
            .load(PROBES)
            .map_err(|e| if seccomp_refuses_bpf() { LoadError::Seccomp } else { LoadError::Load(Box::new(e)) })?;
        let programs = match config.probe_mode {
            ProbeMode::Capture => PROGRAMS,
            ProbeMode::Floor => FLOOR_PROGRAMS,
        };
        let btf = Btf::from_sys_fs().map_err(|e| LoadError::Btf(Box::new(e)))?;
        for &(name, tracepoint) in programs {
            let attach_error = |source| LoadError::Attach { program: name.to_owned(), source: Box::new(source) };
            let program: &mut BtfTracePoint = program_of(&mut ebpf, name)?;
            program.load(tracepoint, &btf).map_err(attach_error)?;
            program.attach().map_err(attach_error)?;
            // How close a program is to the verifier's limit of 1M instructions, for whoever
            // changes the probes next.
            let verified = program.info().ok().and_then(|i| i.verified_instruction_count());
            tracing::debug!(program = name, verified_instructions = ?verified, "probe attached");
        }
        let attached = programs.len();
        // The floor attaches the TLS probes too, with programs that do nothing (see `program_at`).
        let tls_probes = config.tls_probes;
        let tls_route = if tls_probes == TlsProbes::Off {
            Err("TLS probes are off (TRACETAP_TLS_PROBES=off)".to_owned())
        } else {
            choose_tls_route(&mut ebpf, &btf, config.tls_route)?
        };
        let take = |ebpf: &mut Ebpf, name: &'static str| ebpf.take_map(name).ok_or(LoadError::MissingMap(name));
        let tls_hooked = Array::try_from(take(&mut ebpf, maps::TLS_HOOKED)?)
            .map_err(|source| LoadError::Map { name: maps::TLS_HOOKED, source: Box::new(source) })?;
        let ring = RingBuf::try_from(take(&mut ebpf, maps::EVENTS)?)
            .map_err(|source| LoadError::Map { name: maps::EVENTS, source: Box::new(source) })?;
        let losses = PerCpuArray::try_from(take(&mut ebpf, maps::LOSSES)?)
            .map_err(|source| LoadError::Map { name: maps::LOSSES, source: Box::new(source) })?;
        let target_pids = BpfHashMap::try_from(take(&mut ebpf, maps::TARGET_PIDS)?)
            .map_err(|source| LoadError::Map { name: maps::TARGET_PIDS, source: Box::new(source) })?;
        let target_set = Array::try_from(take(&mut ebpf, maps::TARGET_SET)?)
            .map_err(|source| LoadError::Map { name: maps::TARGET_SET, source: Box::new(source) })?;
        let opaque_conns = BpfHashMap::try_from(take(&mut ebpf, maps::OPAQUE_CONNS)?)
            .map_err(|source| LoadError::Map { name: maps::OPAQUE_CONNS, source: Box::new(source) })?;
        let opaque_generation = Array::try_from(take(&mut ebpf, maps::OPAQUE_GENERATION)?)
            .map_err(|source| LoadError::Map { name: maps::OPAQUE_GENERATION, source: Box::new(source) })?;
        let stats = if config.probe_stats {
            match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot enable BPF run-time statistics; probe timings stay at 0");
                    None
                }
            }
        } else {
            None
        };
        let comm_filter = comm[0] != 0;
        let mut probes = Self {
            ebpf,
            ring,
            losses,
            target_pids,
            target_set,
            opaque: OpaqueMaps { conns: opaque_conns, generation: opaque_generation },
            comm_filter,
            target_set_written: None,
            attached,
            _stats: stats,
            tls_links: HashMap::new(),
            tls_objects: HashMap::new(),
            tls_bridges: Vec::new(),
            tls_refused: std::collections::HashSet::new(),
            tls_plans: super::tls::PlanCache::new(tls_probes == TlsProbes::Auto),
            tls_pending: std::collections::HashSet::new(),
            tls_route,
            tls_hooked,
            tls_placement: tls_probes,
            tls_floor: config.probe_mode == ProbeMode::Floor,
        };
        // Nothing is traced yet; with no command filter, every process can be ruled out at once.
        probes.write_target_set(&[]);
        Ok(probes)
    }

    /// Starts tracing a process (it stays traced until [`Probes::untrace`]).
    pub fn trace(&mut self, pid: u32) -> Result<(), aya::maps::MapError> {
        self.target_pids.insert(pid, 1, 0)
    }

    /// Stops tracing a process.
    pub fn untrace(&mut self, pid: u32) {
        let _ = self.target_pids.remove(&pid);
    }

    /// Publishes the whole traced set to the probes' fast path, after [`Probes::trace`] and
    /// [`Probes::untrace`] updated `TARGET_PIDS` (so that a process falls back to the map, never
    /// out of both). Up to [`TARGET_SLOTS`] processes fit; more leave the set incomplete.
    pub fn write_target_set(&mut self, traced: &[u32]) {
        let mut set = TargetSet::default();
        for (slot, pid) in set.tgids.iter_mut().zip(traced) {
            *slot = *pid;
        }
        set.complete = u32::from(traced.len() <= TARGET_SLOTS && !self.comm_filter);
        if self.target_set_written == Some(set) {
            return;
        }
        self.target_set_written = Some(set);
        if let Err(e) = self.target_set.set(0, set, 0) {
            tracing::warn!(error = %e, "cannot update the probes' target set; they fall back to the pid map");
        }
    }

    /// Attaches the TLS probes to process `pid`: to the first of `objects` (see
    /// [`super::tls::objects_of`]) that defines the TLS functions, at the points
    /// [`super::tls::attach_plan`] chooses. A process already hooked is left as it is.
    pub fn hook_tls(&mut self, pid: u32, objects: &[std::path::PathBuf]) -> TlsHook {
        if pid == 0 {
            return TlsHook::NoLibrary;
        }
        if self.tls_links.contains_key(&pid) {
            return TlsHook::AlreadyHooked;
        }
        let mut unreadable = None;
        for object in objects {
            let plan = match self.tls_plans.plan(object) {
                Ok(super::tls::Planned::Ready(plan)) => plan,
                // An earlier candidate decides first: asked again once its plan is made.
                Ok(super::tls::Planned::Pending) => {
                    self.tls_pending.insert(pid);
                    return TlsHook::Pending;
                }
                Err(e) => {
                    // Another candidate may still be the library.
                    unreadable = Some(TlsHook::Failed { object: object.clone(), error: e.to_string() });
                    continue;
                }
            };
            let Some(plan) = plan else { continue };
            return match self.attach_tls(pid, object, &plan) {
                Ok(links) => {
                    self.tls_links.insert(pid, links);
                    self.tls_objects.insert(pid, object.clone());
                    if let Err(e) = self.tls_hooked.set(0, 1, 0) {
                        tracing::warn!(error = %e, "cannot switch the TLS binding on in the probes; TLS connections will not be traced");
                    }
                    let call_sites = plan.iter().filter(|p| p.program.ends_with("_call")).count();
                    TlsHook::Attached { object: object.clone(), call_sites }
                }
                Err(error) => {
                    self.tls_refused.insert(pid);
                    TlsHook::Failed { object: object.clone(), error }
                }
            };
        }
        if unreadable.is_some() {
            self.tls_refused.insert(pid);
        }
        unreadable.unwrap_or(TlsHook::NoLibrary)
    }

    /// Every point of `plan` on `object` for `pid`, or none (what was attached is detached again).
    fn attach_tls(&mut self, pid: u32, object: &Path, plan: &[super::tls::ProbePoint]) -> Result<Vec<TlsLink>, String> {
        let mut links = Vec::with_capacity(plan.len());
        for point in plan {
            match self.attach_point(pid, object, point) {
                Ok(link) => links.push(link),
                Err(e) => {
                    self.detach_tls(links);
                    return Err(e);
                }
            }
        }
        Ok(links)
    }

    fn attach_point(&mut self, pid: u32, object: &Path, point: &super::tls::ProbePoint) -> Result<TlsLink, String> {
        let program = program_at(point, self.tls_floor);
        match &self.tls_route {
            Err(why) => Err(why.clone()),
            Ok(TlsRoute::Multi(programs, _)) => programs
                .attach(program, object, &[point.offset], &[point.cookie], pid)
                .map(TlsLink::Multi)
                .map_err(|e| format!("uprobe-multi link: {e}")),
            Ok(TlsRoute::Tracefs(tracefs)) => {
                let tracefs = tracefs.clone();
                let program = self.uprobe(program).map_err(|e| e.to_string())?;
                let returns = matches!(program.kind(), aya::programs::ProbeKind::Return);
                let fd = program.fd().map_err(|e| e.to_string())?;
                uprobes::attach_tracefs(&tracefs, fd.as_fd(), returns, object, point.offset, point.cookie, pid)
                    .map(TlsLink::Tracefs)
                    .map_err(|e| format!("tracefs uprobe event: {e}"))
            }
            Ok(TlsRoute::PerfPmu) => {
                let Some(pid) = NonZeroU32::new(pid) else { return Err("pid 0".to_owned()) };
                let at = UProbeAttachPoint {
                    location: UProbeAttachLocation::AbsoluteOffset(point.offset),
                    cookie: Some(point.cookie),
                };
                self.uprobe(program)
                    .and_then(|p| p.attach(at, object, UProbeScope::OneProcess(pid)))
                    .map(|link| TlsLink::Perf(program, link))
                    .map_err(|e| format!("perf uprobe: {e}"))
            }
        }
    }

    fn uprobe(&mut self, name: &str) -> Result<&mut UProbe, ProgramError> {
        let program = self.ebpf.program_mut(name).ok_or(ProgramError::NotLoaded)?;
        program.try_into()
    }

    /// Detaches `links`, last first: attached closing probes first, they go opening probes first,
    /// so that no call is noted with nothing left to clear it.
    fn detach_tls(&mut self, links: Vec<TlsLink>) {
        for link in links.into_iter().rev() {
            if let TlsLink::Perf(name, link) = link
                && let Ok(program) = self.uprobe(name)
            {
                let _ = program.detach(link);
            }
        }
    }

    /// Detaches the TLS probes of a process that is no longer traced.
    pub fn unhook_tls(&mut self, pid: u32) {
        self.tls_objects.remove(&pid);
        self.tls_refused.remove(&pid);
        self.tls_pending.remove(&pid);
        if let Some(links) = self.tls_links.remove(&pid) {
            self.detach_tls(links);
        }
    }

    /// The processes to hook again: some plan was made since they were left pending.
    pub fn retry_pending_tls(&mut self) -> Vec<u32> {
        if self.tls_pending.is_empty() || !self.tls_plans.take_made() {
            return Vec::new();
        }
        self.tls_pending.drain().collect()
    }

    /// Whether process `pid` had its TLS probes attached, or refused (each process is tried and
    /// counted once).
    #[must_use]
    pub fn tls_settled(&self, pid: u32) -> bool {
        self.tls_links.contains_key(&pid) || self.tls_refused.contains(&pid)
    }

    /// Whether the TLS probes are loaded (`TRACETAP_TLS_PROBES` is not `off`, and not in the
    /// floor mode of `make bench`).
    #[must_use]
    pub fn captures_tls(&self) -> bool {
        self.tls_placement != TlsProbes::Off
    }

    /// A traced process re-executed itself (an `HAProxy` reload): new workers follow, and each must
    /// have its TLS probes before its first connection, which the agent cannot promise with links
    /// made once it knows the worker (it has to be scheduled, and the kernel may make it wait; see
    /// [`AttachWarmer`]). So, on the uprobe-multi route, the library `pid` was hooked on gets
    /// links for every process that maps it ([`TLS_COOKIE_ANY_PROCESS`]: the probes act for traced
    /// processes only) until a new process has started and [`uprobes::SETTLE`] more, or
    /// [`uprobes::MAX_WAIT_FOR_WORKERS`] at most: the bridge, one per file (pods of one image
    /// reloading together share it). Meanwhile every process mapping that file pays a breakpoint
    /// per TLS call (in a container, `HAProxy`'s own). Returns how many bridge links were made,
    /// `None` when there is nothing to bridge.
    pub fn expect_new_workers(&mut self, pid: u32) -> Option<Result<usize, String>> {
        use std::os::unix::fs::MetadataExt as _;
        let Ok(TlsRoute::Multi(programs, warmer)) = &self.tls_route else { return None };
        if let Some(warmer) = warmer {
            warmer.warm();
        }
        let object = self.tls_objects.get(&pid)?.clone();
        let until = std::time::Instant::now() + uprobes::MAX_WAIT_FOR_WORKERS;
        let file = match std::fs::metadata(&object) {
            Ok(meta) => (meta.dev(), meta.ino()),
            Err(e) => return Some(Err(e.to_string())),
        };
        if let Some(bridge) = self.tls_bridges.iter_mut().find(|b| b.file == file) {
            bridge.until = until;
            bridge.settled = false;
            return Some(Ok(0));
        }
        let plan = match self.tls_plans.plan(&object) {
            Ok(super::tls::Planned::Ready(Some(plan))) => plan,
            // The master's library was planned when it was hooked, unless the cache started over.
            Ok(super::tls::Planned::Ready(None) | super::tls::Planned::Pending) => return None,
            Err(e) => return Some(Err(e.to_string())),
        };
        let mut links = Vec::with_capacity(plan.len());
        for point in plan.iter() {
            let cookie = point.cookie | TLS_COOKIE_ANY_PROCESS;
            match programs.attach(program_at(point, self.tls_floor), &object, &[point.offset], &[cookie], 0) {
                Ok(link) => links.push(link),
                Err(e) => return Some(Err(format!("uprobe-multi link for every process: {e}"))),
            }
        }
        let made = links.len();
        self.tls_bridges.push(Bridge { file, links, until, settled: false });
        Some(Ok(made))
    }

    /// A traced process started: the bridges and the warmer end [`uprobes::SETTLE`] from now.
    pub fn new_process_hooked(&mut self) {
        let soon = std::time::Instant::now() + uprobes::SETTLE;
        for bridge in &mut self.tls_bridges {
            if !bridge.settled {
                bridge.settled = true;
                bridge.until = bridge.until.min(soon);
            }
        }
        if let Ok(TlsRoute::Multi(_, Some(warmer))) = &self.tls_route {
            warmer.settle();
        }
        // The probes may have marked the target set incomplete for the new process.
        self.target_set_written = None;
    }

    /// Drops the bridges of [`Probes::expect_new_workers`] whose time is up.
    pub fn end_bridges_when_due(&mut self) {
        let now = std::time::Instant::now();
        self.tls_bridges.retain_mut(|bridge| {
            if bridge.until > now {
                return true;
            }
            // Opening probes first: a call is never noted with nothing left to clear it.
            while bridge.links.pop().is_some() {}
            tracing::debug!("TLS bridge links dropped");
            false
        });
    }

    /// How the TLS probes reach the kernel, or why they cannot (the one message, see
    /// [`choose_tls_route`]).
    pub fn tls_route(&self) -> Result<Route, &str> {
        self.tls_route.as_ref().map(TlsRoute::route).map_err(String::as_str)
    }

    /// Processes with the TLS probes attached.
    #[must_use]
    pub fn tls_hooked_processes(&self) -> usize {
        self.tls_links.len()
    }

    /// Sums the per-CPU loss counters, by [`tracetap_ebpf_common::Loss`] slot.
    #[must_use]
    pub fn losses(&self) -> [u64; LOSS_SLOTS as usize] {
        let mut out = [0u64; LOSS_SLOTS as usize];
        for (slot, total) in out.iter_mut().enumerate() {
            if let Ok(values) = self.losses.get(&(slot as u32), 0) {
                *total = values.iter().sum();
            }
        }
        out
    }

    /// Runs of all probes and the time they took, in ns (0 unless run-time statistics are on).
    #[must_use]
    pub fn run_stats(&self) -> (u64, u64) {
        self.ebpf
            .programs()
            .filter_map(|(_, p)| p.info().ok())
            .fold((0, 0), |(runs, ns), info| (runs + info.run_count(), ns + info.run_time().as_nanos() as u64))
    }

    /// Waits until the ring buffer has data or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        let mut fds = libc::pollfd { fd: self.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let _ = unsafe { libc::poll(&raw mut fds, 1, ms) };
    }
}

/// The program attached at `point`: its own, or in the floor mode its twin that returns at once.
fn program_at(point: &super::tls::ProbePoint, floor: bool) -> &'static str {
    if floor { super::tls::floor_twin(point.program) } else { point.program }
}

/// The program the route self-test attaches (any TLS program would do: it never runs).
const SELF_TEST_PROGRAM: &str = "ssl_handshake_entry";

/// Tries the routes of [`uprobes`] in order on the agent's own executable (only the one `choice`
/// names, unless it is `Auto`) and returns the first that attaches, or the one message that says,
/// for each route, what refused it and how to fix it. Loads the TLS programs as that route needs
/// them. Only a failure to load the programs for perf links (which every route but the first
/// needs) is an error of the agent's.
fn choose_tls_route(ebpf: &mut Ebpf, btf: &Btf, choice: TlsRouteChoice) -> Result<Result<TlsRoute, String>, LoadError> {
    use super::tls_route::{Refusal, Refusals, no_route_message};
    let tries = |wanted| choice == TlsRouteChoice::Auto || choice == wanted;
    let target = match uprobes::self_test_target() {
        Ok(target) => target,
        Err(e) => {
            return Ok(Err(format!(
                "TLS cannot be traced: the agent cannot find its own code to test the uprobe routes on ({e})"
            )));
        }
    };
    // Events of agents killed before are removed whichever route this one takes.
    let tracefs_dir = uprobes::tracefs_dir();
    if let Some(dir) = &tracefs_dir {
        let removed = uprobes::remove_stale_events(dir, Path::new("/proc"));
        if removed > 0 {
            tracing::info!(removed, tracefs = %dir.display(), "removed uprobe events left by agents that no longer run");
        }
    }
    let pid = std::process::id();
    let multi_error;
    let multi = if tries(TlsRouteChoice::UprobeMulti) {
        let maps = ebpf.maps().map(|(name, map)| (name, map_data(map).fd().as_fd()));
        match MultiPrograms::load(PROBES, maps, btf, &super::tls::PROGRAMS) {
            Ok(programs) => match programs.attach(SELF_TEST_PROGRAM, &target.0, &[target.1], &[0], pid) {
                Ok(_link) => {
                    let warmer = programs.program_fd(SELF_TEST_PROGRAM).and_then(Result::ok).and_then(|fd| {
                        AttachWarmer::start(fd, target.clone())
                            .inspect_err(|e| tracing::warn!(error = %e, "cannot start the uprobe warmer; new workers' first TLS connections may go untraced"))
                            .ok()
                    });
                    return Ok(Ok(TlsRoute::Multi(programs, warmer)));
                }
                Err(e) => {
                    multi_error = e;
                    Refusal::Attach(&multi_error)
                }
            },
            // The verifier's or the object's word, not the kernel's lack of the link type.
            Err(e) => Refusal::Other(e.to_string()),
        }
    } else {
        Refusal::NotTried
    };

    for name in super::tls::PROGRAMS {
        let program: &mut UProbe = program_of(ebpf, name)?;
        program.load().map_err(|source| LoadError::Attach { program: name.to_owned(), source: Box::new(source) })?;
    }
    let program: &mut UProbe = program_of(ebpf, SELF_TEST_PROGRAM)?;
    let at = UProbeAttachPoint { location: UProbeAttachLocation::AbsoluteOffset(target.1), cookie: None };
    let scope = UProbeScope::OneProcess(NonZeroU32::new(pid).expect("the agent is not pid 0"));
    let perf_error;
    let perf = if tries(TlsRouteChoice::Perf) {
        match program.attach(at, &target.0, scope) {
            Ok(link) => {
                let _ = program.detach(link);
                return Ok(Ok(TlsRoute::PerfPmu));
            }
            Err(e) => {
                perf_error = e.to_string();
                Refusal::Attach(&perf_error)
            }
        }
    } else {
        Refusal::NotTried
    };
    let tracefs_error;
    let tracefs = match tracefs_dir {
        _ if !tries(TlsRouteChoice::Tracefs) => Some(Refusal::NotTried),
        Some(dir) => {
            let fd = program.fd().map_err(|source| LoadError::Attach {
                program: SELF_TEST_PROGRAM.to_owned(),
                source: Box::new(source),
            })?;
            match uprobes::attach_tracefs(&dir, fd.as_fd(), false, &target.0, target.1, 0, pid) {
                Ok(_event) => return Ok(Ok(TlsRoute::Tracefs(dir))),
                Err(e) => {
                    tracefs_error = e;
                    Some(Refusal::Attach(&tracefs_error))
                }
            }
        }
        None => None,
    };
    Ok(Err(no_route_message(&Refusals {
        multi,
        perf,
        tracefs,
        perf_event_paranoid: std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
            .ok()
            .and_then(|s| s.trim().parse().ok()),
        seccomp: seccomp_filtered(),
        kernel: kernel_release(),
        forced: choice.name(),
    })))
}

/// The `MapData` of a map, whatever its kind.
fn map_data(map: &aya::maps::Map) -> &MapData {
    use aya::maps::Map;
    match map {
        Map::Array(d)
        | Map::ArrayOfMaps(d)
        | Map::BloomFilter(d)
        | Map::CgroupArray(d)
        | Map::CgroupStorage(d)
        | Map::CgrpStorage(d)
        | Map::CpuMap(d)
        | Map::DevMap(d)
        | Map::DevMapHash(d)
        | Map::HashMap(d)
        | Map::HashOfMaps(d)
        | Map::InodeStorage(d)
        | Map::LpmTrie(d)
        | Map::LruHashMap(d)
        | Map::PerCpuArray(d)
        | Map::PerCpuCgroupStorage(d)
        | Map::PerCpuHashMap(d)
        | Map::PerCpuLruHashMap(d)
        | Map::PerfEventArray(d)
        | Map::ProgramArray(d)
        | Map::Queue(d)
        | Map::ReusePortSockArray(d)
        | Map::RingBuf(d)
        | Map::SockHash(d)
        | Map::SockMap(d)
        | Map::SkStorage(d)
        | Map::Stack(d)
        | Map::StackTraceMap(d)
        | Map::Unsupported(d)
        | Map::XskMap(d) => d,
    }
}

/// The running kernel's release (`uname -r`).
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "release unknown".to_owned(), |r| r.trim().to_owned())
}

/// Whether a seccomp filter applies to the agent.
fn seccomp_filtered() -> bool {
    const SECCOMP_MODE_FILTER: u32 = 2;
    <procfs_core::process::Status as procfs_core::FromRead>::from_file("/proc/self/status")
        .is_ok_and(|status| status.seccomp == Some(SECCOMP_MODE_FILTER))
}

/// The program `name` of the probe object, as its kind `P`.
fn program_of<'a, P>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut P, LoadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| LoadError::MissingProgram(name.to_owned()))?
        .try_into()
        .map_err(|source| LoadError::Attach { program: name.to_owned(), source: Box::new(source) })
}

/// Copies the header out of a record. The caller checked the length.
pub(super) fn read_header(record: &[u8]) -> EventHeader {
    assert!(record.len() >= EventHeader::SIZE);
    // SAFETY: length checked; EventHeader is plain old data valid for any bit pattern; the read
    // is unaligned-safe.
    unsafe { std::ptr::read_unaligned(record.as_ptr().cast::<EventHeader>()) }
}

/// Whether a seccomp filter, not the kernel's own checks, refuses `bpf()`: the agent holds
/// `CAP_BPF`, its status shows a filter, and `bpf()` with an attribute size over a page fails
/// with anything but `E2BIG`. The kernel answers `E2BIG` to that size before any capability or
/// LSM check (`bpf_check_uarg_tail_zero`), so another answer came from the filter (`EPERM` from
/// the runtimes' profiles, `ENOSYS` from some). Called only after loading failed.
fn seccomp_refuses_bpf() -> bool {
    const CAP_BPF: u64 = 1 << 39;
    const SECCOMP_MODE_FILTER: u32 = 2;
    const OVER_A_PAGE: u32 = 64 * 1024 + 1;
    let Ok(status) = <procfs_core::process::Status as procfs_core::FromRead>::from_file("/proc/self/status") else {
        return false;
    };
    if status.seccomp != Some(SECCOMP_MODE_FILTER) || status.capeff & CAP_BPF == 0 {
        return false;
    }
    // SAFETY: the size check fails before the kernel reads through the null attribute pointer;
    // no memory is touched.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, 0, std::ptr::null::<u8>(), OVER_A_PAGE) };
    ret == -1 && std::io::Error::last_os_error().raw_os_error() != Some(libc::E2BIG)
}

fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out pointer.
    unsafe { libc::clock_gettime(clock, &raw mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// The monotonic clock the probes stamp events with (`bpf_ktime_get_ns`).
#[must_use]
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC) as u64
}

/// What to add to a monotonic timestamp to get Unix time, in ns.
#[must_use]
pub fn monotonic_to_unix_offset_ns() -> i128 {
    clock_ns(libc::CLOCK_REALTIME) - clock_ns(libc::CLOCK_MONOTONIC)
}

/// The probes' `OPAQUE_CONNS` and `OPAQUE_GENERATION` (see `super::opaque`).
pub struct OpaqueMaps {
    conns: BpfHashMap<MapData, u64, u64>,
    generation: Array<MapData, u32>,
}

impl super::opaque::MarkSink for OpaqueMaps {
    fn insert(&mut self, key: u64, opened_ns: u64) -> bool {
        self.conns.insert(key, opened_ns, 0).is_ok()
    }

    fn remove(&mut self, key: u64) {
        let _ = self.conns.remove(&key);
    }

    fn publish(&mut self, generation: u32) {
        if let Err(e) = self.generation.set(0, generation, 0) {
            tracing::warn!(error = %e, "cannot update the probes' opaque-connection generation; marked connections keep being copied");
        }
    }
}
