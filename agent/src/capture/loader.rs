//! The agent's one place for `unsafe` and kernel plumbing: loading and attaching the probes (BTF
//! tracepoints, so tracefs is not needed), reading raw records, polling the ring buffer, and the
//! monotonic clock.
#![expect(unsafe_code, reason = "kernel interfaces: poll(2), clock_gettime(2), raw records")]

use std::os::fd::AsRawFd as _;
use std::path::Path;
use std::time::Duration;

use aya::Btf;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};

use aya::programs::{BtfTracePoint, ProgramError};
use aya::{Ebpf, EbpfLoader};
use tracetap_ebpf_common::{COMM_BYTES, EventHeader, LOSS_SLOTS, TARGET_SLOTS, TargetSet, globals, maps};

use super::tls_hooks::{TlsHook, TlsHooks, choose_tls_route};
use crate::config::{Config, ProbeMode, Targets, TlsProbes};

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
pub(super) static PROBES: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracetap"));

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
    /// The TLS probes: where they are attached, and how (what needs the probe object goes
    /// through [`Probes::hook_tls`] and [`Probes::unhook_tls`]).
    pub tls: TlsHooks,
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
        let (drop_rule, drop_threshold) = config.sampler.sampled_out_rule().in_probes();
        let mut ebpf = EbpfLoader::new()
            .override_global(globals::CAPTURE_BYTES, &config.capture_bytes, true)
            .override_global(globals::TARGET_COMM, &comm, true)
            // Wake the agent early when the ring is an eighth full; otherwise it polls every few ms.
            .override_global(globals::WAKEUP_BYTES, &(config.ring_bytes / 8), true)
            // Frontend request heads the sampler drops by their own context are dropped in the
            // probes, when they can tell (`tracetap_ebpf_common::head_drop`).
            .override_global(globals::DROP_RULE, &drop_rule, true)
            .override_global(globals::DROP_THRESHOLD, &drop_threshold, true)
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
            tls: TlsHooks::new(tls_route, tls_hooked, tls_probes, config.probe_mode == ProbeMode::Floor),
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

    /// Attaches the TLS probes to process `pid` (see [`TlsHooks::hook`]).
    pub fn hook_tls(&mut self, pid: u32, objects: &[std::path::PathBuf]) -> TlsHook {
        self.tls.hook(&mut self.ebpf, pid, objects)
    }

    /// Detaches the TLS probes of a process that is no longer traced.
    pub fn unhook_tls(&mut self, pid: u32) {
        self.tls.unhook(&mut self.ebpf, pid);
    }

    /// A traced process started (see [`TlsHooks::new_process_started`]).
    pub fn new_process_hooked(&mut self) {
        self.tls.new_process_started();
        // The probes may have marked the target set incomplete for the new process.
        self.target_set_written = None;
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

/// The program `name` of the probe object, as its kind `P`.
pub(super) fn program_of<'a, P>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut P, LoadError>
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
