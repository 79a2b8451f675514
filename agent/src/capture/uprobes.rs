//! How the TLS uprobes reach the kernel. There are three routes, and which one a node allows
//! depends on its kernel and on the agent's capabilities, not on a version number, so the agent
//! tries them at start, in this order, on a probe of its own executable that never fires
//! ([`self_test_target`]), and keeps the first that works ([`Route`]):
//!
//! 1. **uprobe-multi links** (`BPF_LINK_CREATE` with `BPF_TRACE_UPROBE_MULTI`, Linux 6.6+). They
//!    attach with `CAP_BPF` and `CAP_PERFMON`: no `perf_event_open` is involved. The programs must
//!    be loaded with that expected attach type, which aya 0.14 does not do, so [`MultiPrograms`]
//!    loads the same instructions again: the probe object parsed and relocated by `aya-obj`
//!    against the maps aya already created (the TLS programs share every map with the syscall
//!    probes), then `BPF_PROG_LOAD` as a kprobe-type program.
//! 2. **perf uprobes** (aya's `UProbe`, `perf_event_open` of the uprobe PMU). Linux requires
//!    `CAP_SYS_ADMIN` for them again since commit ba677dbe77af (2025, CVE-2025-38466): root only.
//! 3. **tracefs uprobe events** opened as tracepoint perf events ([`TracefsEvent`]): an event
//!    written to `uprobe_events`, opened with `perf_event_open(PERF_TYPE_TRACEPOINT)` for the one
//!    process and given the program with a perf link (which carries the attach cookie). This is
//!    not gated by that commit; it needs a writable tracefs and, on kernels that check it (6.1),
//!    `kernel.perf_event_paranoid` ≤ 2. Events are host-wide: they are named by the agent's pid
//!    (group `tracetap_PID`), removed when detached, and the groups of agents that no longer run
//!    are removed at start ([`remove_stale_events`]).
//!
//! Every link here detaches when dropped. Links are bound to one process (the `pid` of the
//! uprobe-multi link, the perf event's task), so other programs that map the same library never
//! pay a breakpoint.
#![expect(unsafe_code, reason = "bpf(2) and perf_event_open(2) have no safe wrapper in aya 0.14 for these commands")]

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use aya_obj::generated::{
    bpf_attach_type::{BPF_PERF_EVENT, BPF_TRACE_UPROBE_MULTI},
    bpf_attr, bpf_cmd, bpf_insn,
    bpf_prog_type::BPF_PROG_TYPE_KPROBE,
    perf_event_attr,
    perf_type_id::PERF_TYPE_TRACEPOINT,
};

/// The route the TLS probes take on this node (see the module notes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Multi,
    PerfPmu,
    Tracefs,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Multi => "uprobe-multi links",
            Self::PerfPmu => "perf uprobes",
            Self::Tracefs => "tracefs uprobe events",
        })
    }
}

/// `BPF_F_UPROBE_MULTI_RETURN`: every offset of the link is a return probe.
const UPROBE_MULTI_RETURN: u32 = 1;

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a fully initialised `bpf_attr` whose pointers outlive the call; the
    // kernel reads at most `size_of::<bpf_attr>()` bytes and may write some back (the verifier
    // log's true size, Linux 6.4+), hence the exclusive borrow.
    let ret =
        unsafe { libc::syscall(libc::SYS_bpf, cmd as libc::c_long, std::ptr::from_mut(attr), size_of::<bpf_attr>()) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a successful BPF_PROG_LOAD or BPF_LINK_CREATE returns a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
}

fn zeroed_attr() -> bpf_attr {
    // SAFETY: `bpf_attr` is a C union of integers and arrays; all zeroes is its documented
    // "unset" value, and the kernel requires unused bytes to be zero.
    unsafe { std::mem::zeroed() }
}

/// A program of the probe object, loaded for uprobe-multi links.
#[derive(Debug)]
pub struct MultiProgram {
    fd: OwnedFd,
    /// A `uretprobe` program: its links are return probes.
    returns: bool,
}

/// The TLS programs loaded for uprobe-multi links, by name.
#[derive(Debug, Default)]
pub struct MultiPrograms {
    programs: HashMap<&'static str, MultiProgram>,
}

/// Why loading the programs for uprobe-multi links failed.
#[derive(Debug, thiserror::Error)]
pub enum MultiLoadError {
    #[error("parsing the probe object: {0}")]
    Parse(String),
    #[error("relocating the probe object: {0}")]
    Relocate(String),
    #[error("the probe object has no uprobe program {0}")]
    Missing(&'static str),
    #[error("loading {program} for uprobe-multi links: {error}{verifier}")]
    Load { program: &'static str, error: io::Error, verifier: String },
}

impl MultiPrograms {
    /// Loads `names` from the probe object `object`, relocated against the maps aya created for it
    /// (`maps`: each map's name and descriptor) and against the kernel's BTF.
    pub fn load<'a>(
        object: &[u8],
        maps: impl Iterator<Item = (&'a str, BorrowedFd<'a>)>,
        btf: &aya::Btf,
        names: &[&'static str],
    ) -> Result<Self, MultiLoadError> {
        let mut obj = aya_obj::Object::parse(object).map_err(|e| MultiLoadError::Parse(e.to_string()))?;
        obj.relocate_btf(btf).map_err(|e| MultiLoadError::Relocate(e.to_string()))?;
        let definitions = obj.maps.clone();
        let fds: Vec<(&str, i32, &aya_obj::Map)> =
            maps.filter_map(|(name, fd)| definitions.get(name).map(|def| (name, fd.as_raw_fd(), def))).collect();
        let text_sections = obj.functions.keys().map(|(section, _)| *section).collect();
        obj.relocate_maps(fds.into_iter(), &text_sections).map_err(|e| MultiLoadError::Relocate(e.to_string()))?;
        obj.relocate_calls(&text_sections).map_err(|e| MultiLoadError::Relocate(e.to_string()))?;
        let mut programs = HashMap::new();
        for &name in names {
            let program = obj.programs.get(name).ok_or(MultiLoadError::Missing(name))?;
            let returns = match program.section {
                aya_obj::ProgramSection::UProbe { .. } => false,
                aya_obj::ProgramSection::URetProbe { .. } => true,
                _ => return Err(MultiLoadError::Missing(name)),
            };
            let function = obj.functions.get(&program.function_key()).ok_or(MultiLoadError::Missing(name))?;
            let fd = load_for_multi(name, &function.instructions, &obj.license)
                .map_err(|(error, verifier)| MultiLoadError::Load { program: name, error, verifier })?;
            programs.insert(name, MultiProgram { fd, returns });
        }
        Ok(Self { programs })
    }

    /// Attaches `program` at `offsets` of `object` (with one cookie each) for process `pid`.
    pub fn attach(
        &self,
        program: &str,
        object: &Path,
        offsets: &[u64],
        cookies: &[u64],
        pid: u32,
    ) -> io::Result<OwnedFd> {
        let program =
            self.programs.get(program).ok_or_else(|| io::Error::other(format!("program {program} not loaded")))?;
        link_multi(program.fd.as_fd(), program.returns, object, offsets, cookies, pid)
    }

    /// A duplicate of `program`'s descriptor (for the [`AttachWarmer`]).
    #[must_use]
    pub fn program_fd(&self, program: &str) -> Option<io::Result<OwnedFd>> {
        self.programs.get(program).map(|p| p.fd.try_clone())
    }
}

/// `BPF_PROG_LOAD` of a kprobe-type program with the expected attach type of uprobe-multi links.
/// On failure, the verifier's last lines come back with the error.
fn load_for_multi(name: &str, instructions: &[bpf_insn], license: &CString) -> Result<OwnedFd, (io::Error, String)> {
    let attempt = |log: Option<&mut Vec<u8>>| {
        let mut attr = zeroed_attr();
        // SAFETY: writing plain integers into the `prog_load` member of a zeroed union; the
        // pointers (instructions, license, log) outlive the call.
        unsafe {
            let load = &mut attr.__bindgen_anon_3;
            load.prog_type = BPF_PROG_TYPE_KPROBE as u32;
            load.expected_attach_type = BPF_TRACE_UPROBE_MULTI as u32;
            load.insn_cnt = instructions.len() as u32;
            load.insns = instructions.as_ptr() as u64;
            load.license = license.as_ptr() as u64;
            // The kernel takes [a-zA-Z0-9_.] and 15 bytes; the TLS programs' names are such.
            for (slot, byte) in load.prog_name.iter_mut().zip(name.bytes().take(15)) {
                *slot = byte as libc::c_char;
            }
            if let Some(log) = log {
                load.log_level = 1;
                load.log_size = log.len() as u32;
                load.log_buf = log.as_mut_ptr() as u64;
            }
        }
        bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    match attempt(None) {
        Ok(fd) => Ok(fd),
        Err(error) => {
            let mut log = vec![0u8; 256 * 1024];
            let _ = attempt(Some(&mut log));
            let text =
                String::from_utf8_lossy(&log[..log.iter().position(|b| *b == 0).unwrap_or(log.len())]).into_owned();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            let verifier = if tail.is_empty() {
                String::new()
            } else {
                format!(" (verifier: {})", tail.into_iter().rev().collect::<Vec<_>>().join(" / "))
            };
            Err((error, verifier))
        }
    }
}

/// A uprobe-multi link of `program` at `offsets` of `object` for process `pid`.
fn link_multi(
    program: BorrowedFd<'_>,
    returns: bool,
    object: &Path,
    offsets: &[u64],
    cookies: &[u64],
    pid: u32,
) -> io::Result<OwnedFd> {
    assert_eq!(offsets.len(), cookies.len(), "one cookie per offset");
    let path = c_path(object)?;
    let mut attr = zeroed_attr();
    // SAFETY: writing plain integers into the `link_create` member of a zeroed union; the
    // pointers (path, offsets, cookies) outlive the call.
    unsafe {
        let link = &mut attr.link_create;
        link.__bindgen_anon_1.prog_fd = program.as_raw_fd() as u32;
        link.attach_type = BPF_TRACE_UPROBE_MULTI as u32;
        let multi = &mut link.__bindgen_anon_3.uprobe_multi;
        multi.path = path.as_ptr() as u64;
        multi.offsets = offsets.as_ptr() as u64;
        multi.cookies = cookies.as_ptr() as u64;
        multi.cnt = offsets.len() as u32;
        multi.flags = if returns { UPROBE_MULTI_RETURN } else { 0 };
        multi.pid = pid;
    }
    bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

/// Keeps the first uprobe-multi link of a new `HAProxy` worker fast.
///
/// Registering a uprobe takes the kernel's `dup_mmap_sem` for writing, and a writer that finds it
/// idle waits for an RCU grace period first (`rcu_sync_enter`): measured here at 6 to 15 ms for
/// the first link of a new worker, against 10 µs for the next ones. A worker accepts connections
/// within that time, and their handshakes run without the probes. The semaphore stays in writer
/// mode for a grace period after each writer leaves, so the agent registers a probe that never
/// fires (the self-test's) every millisecond from the moment a traced `HAProxy` re-executes itself
/// (a reload: it forks its new workers once it has read its configuration) until a new process
/// has started and [`SETTLE`] more, or [`MAX_WAIT_FOR_WORKERS`] at most: the worker's links then
/// wait for nothing. While it warms, `fork` on the node takes the semaphore's slower read path (an
/// atomic operation), and each registration costs the agent about 10 µs.
#[derive(Debug)]
pub struct AttachWarmer {
    until: std::sync::Arc<(std::sync::Mutex<Option<std::time::Instant>>, std::sync::Condvar)>,
}

/// The longest the agent waits for new workers after a traced process re-executes itself (an
/// `HAProxy` that reads a large configuration, many certificates, may take seconds).
pub const MAX_WAIT_FOR_WORKERS: std::time::Duration = std::time::Duration::from_secs(10);

/// How long the warmer and the bridge go on once a new process started after the re-execution
/// (its links are in by then; a second worker, if any, follows within it).
pub const SETTLE: std::time::Duration = std::time::Duration::from_millis(250);

impl AttachWarmer {
    /// Starts the warming thread, which registers `program` at the self-test target when asked.
    pub fn start(program: OwnedFd, target: (PathBuf, u64)) -> io::Result<Self> {
        let until = std::sync::Arc::new((std::sync::Mutex::new(None::<std::time::Instant>), std::sync::Condvar::new()));
        let shared = std::sync::Arc::clone(&until);
        let pid = std::process::id();
        std::thread::Builder::new().name("uprobe-warmer".into()).spawn(move || {
            let (lock, wake) = &*shared;
            loop {
                let Ok(mut guard) = lock.lock() else { return };
                while guard.is_none_or(|t| t <= std::time::Instant::now()) {
                    *guard = None;
                    let Ok(g) = wake.wait(guard) else { return };
                    guard = g;
                }
                drop(guard);
                let _ = link_multi(program.as_fd(), false, &target.0, &[target.1], &[0], pid);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })?;
        Ok(Self { until })
    }

    /// Warms until [`MAX_WAIT_FOR_WORKERS`] from now, or [`Self::settle`].
    pub fn warm(&self) {
        self.set(|_| Some(std::time::Instant::now() + MAX_WAIT_FOR_WORKERS));
    }

    /// A new process started: warming stops [`SETTLE`] from now, if it was to go on longer.
    pub fn settle(&self) {
        let soon = std::time::Instant::now() + SETTLE;
        self.set(|until| until.map(|t| t.min(soon)));
    }

    fn set(&self, change: impl FnOnce(Option<std::time::Instant>) -> Option<std::time::Instant>) {
        let (lock, wake) = &*self.until;
        if let Ok(mut until) = lock.lock() {
            *until = change(*until);
            wake.notify_one();
        }
    }
}

/// A uprobe event of the agent's own in tracefs, opened as a tracepoint perf event for one
/// process, with a program linked to it. Dropping it detaches the program, closes the event and
/// removes it from `uprobe_events` (in that order: a perf event still open keeps its uprobe event
/// busy).
#[derive(Debug)]
pub struct TracefsEvent {
    /// `Some` until dropped; the link holds the perf event, so it goes first.
    link: Option<OwnedFd>,
    perf: Option<OwnedFd>,
    tracefs: PathBuf,
    /// `GROUP/EVENT`.
    name: String,
}

impl Drop for TracefsEvent {
    fn drop(&mut self) {
        drop(self.link.take());
        drop(self.perf.take());
        if let Err(e) = write_events(&self.tracefs, &format!("-:{}\n", self.name)) {
            tracing::debug!(event = %self.name, error = %e, "cannot remove the tracefs uprobe event");
        }
    }
}

/// Where tracefs is mounted, if it is and it has uprobe events.
#[must_use]
pub fn tracefs_dir() -> Option<PathBuf> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .map(PathBuf::from)
        .find(|dir| dir.join("uprobe_events").exists())
}

/// The group of this agent's events.
fn own_group() -> String {
    format!("tracetap_{}", std::process::id())
}

fn write_events(tracefs: &Path, line: &str) -> io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().append(true).open(tracefs.join("uprobe_events"))?;
    file.write_all(line.as_bytes())
}

/// Removes the events of agents that no longer run (`tracetap_PID` groups whose pid is gone or is
/// not a tracetap). Returns how many were removed.
#[must_use]
pub fn remove_stale_events(tracefs: &Path, proc_root: &Path) -> usize {
    let Ok(listing) = std::fs::read_to_string(tracefs.join("uprobe_events")) else { return 0 };
    let mut removed = 0;
    for name in stale_events(&listing, |pid| {
        std::fs::read_to_string(proc_root.join(pid.to_string()).join("comm")).is_ok_and(|c| c.starts_with("tracetap"))
    }) {
        if write_events(tracefs, &format!("-:{name}\n")).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The `GROUP/EVENT` names in a `uprobe_events` listing that belong to tracetap agents for which
/// `alive` says no.
fn stale_events(listing: &str, alive: impl Fn(u32) -> bool) -> Vec<String> {
    listing
        .lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once(':')?;
            let name = rest.split_whitespace().next()?;
            let (group, _) = name.split_once('/')?;
            let pid: u32 = group.strip_prefix("tracetap_")?.parse().ok()?;
            (!alive(pid)).then(|| name.to_owned())
        })
        .collect()
}

/// Which step of [`attach_tracefs`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TracefsStep {
    /// Writing the event to `uprobe_events` (or reading its id back).
    Write,
    /// `perf_event_open` of the event: where `kernel.perf_event_paranoid` 3 refuses (6.1).
    Open,
    /// The perf link of the program to the event.
    Link,
}

/// A failed [`attach_tracefs`].
#[derive(Debug, thiserror::Error)]
#[error("{}: {error}", match step {
    TracefsStep::Write => "writing the event to uprobe_events",
    TracefsStep::Open => "opening the event (perf_event_open)",
    TracefsStep::Link => "linking the program to the event",
})]
pub struct TracefsError {
    pub step: TracefsStep,
    pub error: io::Error,
}

/// Creates a uprobe event at `offset` of `object` (a return probe when `returns`), opens it for
/// process `pid` and links `program` to it with `cookie`.
pub fn attach_tracefs(
    tracefs: &Path,
    program: BorrowedFd<'_>,
    returns: bool,
    object: &Path,
    offset: u64,
    cookie: u64,
    pid: u32,
) -> Result<TracefsEvent, TracefsError> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let fail = |step| move |error| TracefsError { step, error };
    // The kernel splits an event definition at white space.
    let path =
        object.to_str().filter(|p| !p.chars().any(|c| c.is_whitespace() || c.is_control())).ok_or_else(|| {
            fail(TracefsStep::Write)(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} cannot be named in uprobe_events", object.display()),
            ))
        })?;
    let name = format!("{}/e{}", own_group(), NEXT.fetch_add(1, Ordering::Relaxed));
    let kind = if returns { 'r' } else { 'p' };
    write_events(tracefs, &format!("{kind}:{name} {path}:{offset:#x}\n")).map_err(fail(TracefsStep::Write))?;
    // From here on the event exists: a failure removes it.
    let remove = |step| {
        let name = &name;
        move |error| {
            let _ = write_events(tracefs, &format!("-:{name}\n"));
            TracefsError { step, error }
        }
    };
    let id: u64 = std::fs::read_to_string(tracefs.join("events").join(&name).join("id"))
        .and_then(|id| id.trim().parse().map_err(|_| io::Error::other("the event's id is not a number")))
        .map_err(remove(TracefsStep::Write))?;
    let perf = perf_tracepoint(id, pid).map_err(remove(TracefsStep::Open))?;
    let link = match link_perf_event(program, perf.as_fd(), cookie) {
        Ok(link) => link,
        Err(error) => {
            // An open perf event keeps its uprobe event busy: closed first.
            drop(perf);
            return Err(remove(TracefsStep::Link)(error));
        }
    };
    Ok(TracefsEvent { link: Some(link), perf: Some(perf), tracefs: tracefs.to_owned(), name })
}

/// `perf_event_open` of tracepoint `id` for process `pid` on any CPU.
fn perf_tracepoint(id: u64, pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: all zeroes is a valid `perf_event_attr` (counting, enabled, no flags).
    let mut attr: perf_event_attr = unsafe { std::mem::zeroed() };
    attr.type_ = PERF_TYPE_TRACEPOINT as u32;
    attr.size = size_of::<perf_event_attr>() as u32;
    attr.config = id;
    attr.__bindgen_anon_1.sample_period = 1;
    // SAFETY: `attr` is valid for the call; the result is checked.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            std::ptr::from_ref(&attr),
            pid as libc::pid_t,
            -1 as libc::c_int,
            -1 as libc::c_int,
            libc::c_ulong::from(aya_obj::generated::PERF_FLAG_FD_CLOEXEC),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
}

/// A perf link of `program` to the perf event `perf`, with an attach cookie.
fn link_perf_event(program: BorrowedFd<'_>, perf: BorrowedFd<'_>, cookie: u64) -> io::Result<OwnedFd> {
    let mut attr = zeroed_attr();
    // SAFETY: plain integers into the `link_create` member of a zeroed union.
    unsafe {
        let link = &mut attr.link_create;
        link.__bindgen_anon_1.prog_fd = program.as_raw_fd() as u32;
        link.__bindgen_anon_2.target_fd = perf.as_raw_fd() as u32;
        link.attach_type = BPF_PERF_EVENT as u32;
        link.__bindgen_anon_3.perf_event.bpf_cookie = cookie;
    }
    bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr)
}

/// The function the route self-test probes: never called, so its probe never fires.
#[inline(never)]
extern "C" fn self_test_function() -> u64 {
    std::hint::black_box(0x7472_6163_6574_6170)
}

/// Where the self-test probes: the agent's own executable (as `/proc/self/exe`, which the kernel
/// follows to the file) and the file offset of [`self_test_function`] in it.
pub fn self_test_target() -> io::Result<(PathBuf, u64)> {
    use procfs_core::FromBufRead as _;
    use procfs_core::process::MemoryMaps;
    let address = self_test_function as *const () as u64;
    let maps = MemoryMaps::from_buf_read(io::BufReader::new(std::fs::File::open("/proc/self/maps")?))
        .map_err(io::Error::other)?;
    let map = maps
        .into_iter()
        .find(|m| (m.address.0..m.address.1).contains(&address))
        .ok_or_else(|| io::Error::other("the agent's own code is not in /proc/self/maps"))?;
    Ok((PathBuf::from("/proc/self/exe"), address - map.address.0 + map.offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_events_are_those_of_agents_gone() {
        let listing = "p:tracetap_10/e0 /usr/lib/libssl.so.3:0x1234\n\
                       r:tracetap_10/e1 /usr/lib/libssl.so.3:0x1234\n\
                       p:tracetap_20/e0 /usr/lib/libssl.so.3:0x1234\n\
                       p:uprobes/theirs /bin/bash:0x10\n\
                       p:tracetap_x/e0 /bin/bash:0x10\n\
                       garbage\n";
        let stale = stale_events(listing, |pid| pid == 20);
        assert_eq!(stale, ["tracetap_10/e0", "tracetap_10/e1"]);
    }

    #[test]
    fn the_self_test_target_is_the_functions_first_byte() {
        let (path, offset) = self_test_target().unwrap();
        let code = std::fs::read(&path).unwrap();
        let at = usize::try_from(offset).unwrap();
        // SAFETY: reading the function's first bytes from the agent's own mapped code.
        let mapped = unsafe { std::slice::from_raw_parts(self_test_function as *const u8, 8) };
        assert_eq!(&code[at..at + 8], mapped);
    }
}
