//! The TLS probes of each traced process: which file they go on and where (the plan, from
//! `super::tls`), attached by the route this kernel allows (`super::uprobes`, chosen at start by
//! [`choose_tls_route`]), the bridge links that cover a reload's new workers, and what is left to
//! detach when a process goes. Every process is tried once and counted once (`settled`); a
//! process whose file is not planned yet waits (`pending`) and is tried again once a plan is made.
//! Links are detached last first, so that a call is never noted with nothing left to clear it.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::os::fd::AsFd as _;
use std::path::{Path, PathBuf};

use aya::maps::{Array, MapData};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::{ProgramError, UProbe};
use aya::{Btf, Ebpf};
use tracetap_ebpf_common::TLS_COOKIE_ANY_PROCESS;

use super::detach::{Detachable, Detacher};
use super::loader::{LoadError, PROBES, program_of};
use super::uprobes::{self, AttachWarmer, MultiPrograms, Route, TracefsEvent};
use crate::config::{TlsProbes, TlsRoute as TlsRouteChoice};

/// The TLS probes of every traced process.
pub struct TlsHooks {
    /// The TLS probes attached to each process (see [`TlsHooks::hook`]).
    links: HashMap<u32, Vec<TlsLink>>,
    /// The object file each hooked process's TLS probes are on.
    objects: HashMap<u32, PathBuf>,
    /// Links for every process mapping a library, over a reload (see [`TlsHooks::expect_new_workers`]).
    bridges: Vec<Bridge>,
    /// Processes waiting for the plan of one of their files (see [`super::tls::PlanCache`]).
    pending: HashSet<u32>,
    /// Processes waiting for their old links to be detached before they are hooked again (see
    /// [`Detacher::detaching`]).
    after_detach: HashSet<u32>,
    /// Processes whose TLS probes could not be attached (counted once each).
    refused: HashSet<u32>,
    /// Attach plans by file, so that a new worker of a known `HAProxy` is hooked without reading
    /// its library again.
    plans: super::tls::PlanCache,
    /// How the TLS probes reach the kernel here, or why they cannot (chosen at start, see
    /// [`super::uprobes`]).
    route: Result<TlsRoute, String>,
    /// `TLS_HOOKED`, set once the first process is hooked.
    hooked: Array<MapData, u32>,
    /// `TRACETAP_TLS_PROBES`.
    placement: TlsProbes,
    /// `TRACETAP_PROBE_MODE=floor`: every TLS probe point gets a program that returns at once.
    floor: bool,
    /// Where links go when their process does (detaching waits for the kernel, see there).
    detacher: Detacher,
}

/// The route the TLS probes take, with what it needs.
pub(super) enum TlsRoute {
    /// With the warmer that keeps a new worker's first link fast, when it could be started.
    Multi(MultiPrograms, Option<AttachWarmer>),
    PerfPmu,
    Tracefs(PathBuf),
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
/// (see [`TlsHooks::expect_new_workers`]). Dropped last link first (opening probes first).
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
    Multi(std::os::fd::OwnedFd),
    Tracefs(TracefsEvent),
}

/// What [`TlsHooks::hook`] found in a process.
#[derive(Debug)]
pub enum TlsHook {
    /// The probes are attached to the functions in this file: at their call sites, or at their
    /// entries and returns (see [`super::tls`]); `call_sites` counts the functions probed at
    /// their call site.
    Attached { object: PathBuf, call_sites: usize },
    /// No mapped file exports the TLS functions: the process does not use TLS (or links a
    /// library stripped of its symbols).
    NoLibrary,
    /// The process has its TLS probes already (hooked when it started).
    AlreadyHooked,
    /// A file of the process is being read for its plan, off the capture thread, or the links
    /// it had before it was let go are still being detached: asked again when
    /// [`TlsHooks::retry_pending`] lists it.
    Pending,
    /// The process maps a TLS library but attaching failed.
    Failed { object: PathBuf, error: String },
}

impl TlsHooks {
    /// The TLS probes as `placement` and the `route` chosen at start say (`floor`: programs that
    /// return at once, for `make bench`); `hooked` is the probes' `TLS_HOOKED`.
    pub(super) fn new(
        route: Result<TlsRoute, String>,
        hooked: Array<MapData, u32>,
        placement: TlsProbes,
        floor: bool,
    ) -> Self {
        Self {
            links: HashMap::new(),
            objects: HashMap::new(),
            bridges: Vec::new(),
            pending: HashSet::new(),
            after_detach: HashSet::new(),
            refused: HashSet::new(),
            plans: super::tls::PlanCache::new(placement == TlsProbes::Auto),
            route,
            hooked,
            placement,
            floor,
            detacher: Detacher::start(),
        }
    }

    /// Attaches the TLS probes to process `pid`: to the first of `objects` (see
    /// [`super::tls::objects_of`]) that defines the TLS functions, at the points
    /// [`super::tls::attach_plan`] chooses. A process already hooked is left as it is.
    pub fn hook(&mut self, ebpf: &mut Ebpf, pid: u32, objects: &[PathBuf]) -> TlsHook {
        if pid == 0 {
            return TlsHook::NoLibrary;
        }
        if self.links.contains_key(&pid) {
            return TlsHook::AlreadyHooked;
        }
        if self.detacher.detaching(pid) {
            // Let go a moment ago and traced again: a second set of probes would report its
            // plaintext twice. Asked again when [`TlsHooks::retry_pending`] lists it.
            self.after_detach.insert(pid);
            return TlsHook::Pending;
        }
        let mut unreadable = None;
        for object in objects {
            let plan = match self.plans.plan(object) {
                Ok(super::tls::Planned::Ready(plan)) => plan,
                // An earlier candidate decides first: asked again once its plan is made.
                Ok(super::tls::Planned::Pending) => {
                    self.pending.insert(pid);
                    return TlsHook::Pending;
                }
                Err(e) => {
                    // Another candidate may still be the library.
                    unreadable = Some(TlsHook::Failed { object: object.clone(), error: e.to_string() });
                    continue;
                }
            };
            let Some(plan) = plan else { continue };
            return match self.attach(ebpf, pid, object, &plan) {
                Ok(links) => {
                    self.links.insert(pid, links);
                    self.objects.insert(pid, object.clone());
                    if let Err(e) = self.hooked.set(0, 1, 0) {
                        tracing::warn!(error = %e, "cannot switch the TLS binding on in the probes; TLS connections will not be traced");
                    }
                    let call_sites = plan.iter().filter(|p| p.program.ends_with("_call")).count();
                    TlsHook::Attached { object: object.clone(), call_sites }
                }
                Err(error) => {
                    self.refused.insert(pid);
                    TlsHook::Failed { object: object.clone(), error }
                }
            };
        }
        if unreadable.is_some() {
            self.refused.insert(pid);
        }
        unreadable.unwrap_or(TlsHook::NoLibrary)
    }

    /// Every point of `plan` on `object` for `pid`, or none (what was attached is detached again).
    fn attach(
        &mut self,
        ebpf: &mut Ebpf,
        pid: u32,
        object: &Path,
        plan: &[super::tls::ProbePoint],
    ) -> Result<Vec<TlsLink>, String> {
        let mut links = Vec::with_capacity(plan.len());
        for point in plan {
            match self.attach_point(ebpf, pid, object, point) {
                Ok(link) => links.push(link),
                Err(e) => {
                    self.detacher.detach(Some(pid), detachable(ebpf, links));
                    return Err(e);
                }
            }
        }
        Ok(links)
    }

    fn attach_point(
        &mut self,
        ebpf: &mut Ebpf,
        pid: u32,
        object: &Path,
        point: &super::tls::ProbePoint,
    ) -> Result<TlsLink, String> {
        let program = program_at(point, self.floor);
        match &self.route {
            Err(why) => Err(why.clone()),
            Ok(TlsRoute::Multi(programs, _)) => programs
                .attach(program, object, &[point.offset], &[point.cookie], pid)
                .map(TlsLink::Multi)
                .map_err(|e| format!("uprobe-multi link: {e}")),
            Ok(TlsRoute::Tracefs(tracefs)) => {
                let tracefs = tracefs.clone();
                let program = uprobe(ebpf, program).map_err(|e| e.to_string())?;
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
                uprobe(ebpf, program)
                    .and_then(|p| p.attach(at, object, UProbeScope::OneProcess(pid)))
                    .map(|link| TlsLink::Perf(program, link))
                    .map_err(|e| format!("perf uprobe: {e}"))
            }
        }
    }

    /// Detaches the TLS probes of a process that is no longer traced.
    pub fn unhook(&mut self, ebpf: &mut Ebpf, pid: u32) {
        self.objects.remove(&pid);
        self.refused.remove(&pid);
        self.pending.remove(&pid);
        self.after_detach.remove(&pid);
        if let Some(links) = self.links.remove(&pid) {
            self.detacher.detach(Some(pid), detachable(ebpf, links));
        }
    }

    /// The processes to hook again: some plan was made since they were left pending, or their
    /// old links are detached now.
    pub fn retry_pending(&mut self) -> Vec<u32> {
        let mut due = Vec::new();
        if !self.pending.is_empty() && self.plans.take_made() {
            due.extend(self.pending.drain());
        }
        let detacher = &self.detacher;
        self.after_detach.retain(|pid| {
            let waits = detacher.detaching(*pid);
            if !waits {
                due.push(*pid);
            }
            waits
        });
        due
    }

    /// Whether process `pid` had its TLS probes attached, or refused (each process is tried and
    /// counted once).
    #[must_use]
    pub fn settled(&self, pid: u32) -> bool {
        self.links.contains_key(&pid) || self.refused.contains(&pid)
    }

    /// Whether the TLS probes are loaded (`TRACETAP_TLS_PROBES` is not `off`; in the floor mode
    /// of `make bench` they are, with programs that return at once).
    #[must_use]
    pub fn captures(&self) -> bool {
        self.placement != TlsProbes::Off
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
        let Ok(TlsRoute::Multi(programs, warmer)) = &self.route else { return None };
        if let Some(warmer) = warmer {
            warmer.warm();
        }
        let object = self.objects.get(&pid)?.clone();
        let until = std::time::Instant::now() + uprobes::MAX_WAIT_FOR_WORKERS;
        let file = match std::fs::metadata(&object) {
            Ok(meta) => (meta.dev(), meta.ino()),
            Err(e) => return Some(Err(e.to_string())),
        };
        if let Some(bridge) = self.bridges.iter_mut().find(|b| b.file == file) {
            bridge.until = until;
            bridge.settled = false;
            return Some(Ok(0));
        }
        let plan = match self.plans.plan(&object) {
            Ok(super::tls::Planned::Ready(Some(plan))) => plan,
            // The master's library was planned when it was hooked, unless the cache started over.
            Ok(super::tls::Planned::Ready(None) | super::tls::Planned::Pending) => return None,
            Err(e) => return Some(Err(e.to_string())),
        };
        let mut links = Vec::with_capacity(plan.len());
        for point in plan.iter() {
            let cookie = point.cookie | TLS_COOKIE_ANY_PROCESS;
            match programs.attach(program_at(point, self.floor), &object, &[point.offset], &[cookie], 0) {
                Ok(link) => links.push(link),
                Err(e) => return Some(Err(format!("uprobe-multi link for every process: {e}"))),
            }
        }
        let made = links.len();
        self.bridges.push(Bridge { file, links, until, settled: false });
        Some(Ok(made))
    }

    /// Drops the bridges of [`TlsHooks::expect_new_workers`] whose time is up.
    pub fn end_bridges_when_due(&mut self) {
        let now = std::time::Instant::now();
        self.bridges.retain_mut(|bridge| {
            if bridge.until > now {
                return true;
            }
            // Opening probes first: a call is never noted with nothing left to clear it.
            let links = bridge.links.drain(..).rev().map(|fd| Box::new(fd) as Detachable).collect();
            self.detacher.detach(None, links);
            tracing::debug!("TLS bridge links let go");
            false
        });
    }

    /// How the TLS probes reach the kernel, or why they cannot (the one message, see
    /// [`choose_tls_route`]).
    pub fn route(&self) -> Result<Route, &str> {
        self.route.as_ref().map(TlsRoute::route).map_err(String::as_str)
    }

    /// Processes with the TLS probes attached.
    #[must_use]
    pub fn hooked_processes(&self) -> usize {
        self.links.len()
    }

    /// TLS probe links let go and not detached yet (see [`super::detach`]).
    #[must_use]
    pub fn links_detaching(&self) -> usize {
        self.detacher.waiting()
    }

    /// A traced process started: the bridges and the warmer end [`uprobes::SETTLE`] from now.
    pub fn new_process_started(&mut self) {
        let soon = std::time::Instant::now() + uprobes::SETTLE;
        for bridge in &mut self.bridges {
            if !bridge.settled {
                bridge.settled = true;
                bridge.until = bridge.until.min(soon);
            }
        }
        if let Ok(TlsRoute::Multi(_, Some(warmer))) = &self.route {
            warmer.settle();
        }
    }
}

/// The uprobe program `name` of the probe object.
fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe, ProgramError> {
    let program = ebpf.program_mut(name).ok_or(ProgramError::NotLoaded)?;
    program.try_into()
}

/// `links` as owned values that detach when dropped, in the order to drop them: last first
/// (attached closing probes first, they go opening probes first, so that no call is noted with
/// nothing left to clear it).
fn detachable(ebpf: &mut Ebpf, links: Vec<TlsLink>) -> Vec<Detachable> {
    let mut out: Vec<Detachable> = Vec::with_capacity(links.len());
    for link in links.into_iter().rev() {
        match link {
            TlsLink::Perf(name, id) => {
                if let Ok(program) = uprobe(ebpf, name)
                    && let Ok(owned) = program.take_link(id)
                {
                    out.push(Box::new(owned));
                }
            }
            TlsLink::Multi(fd) => out.push(Box::new(fd)),
            TlsLink::Tracefs(event) => out.push(Box::new(event)),
        }
    }
    out
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
pub(super) fn choose_tls_route(
    ebpf: &mut Ebpf,
    btf: &Btf,
    choice: TlsRouteChoice,
) -> Result<Result<TlsRoute, String>, LoadError> {
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
