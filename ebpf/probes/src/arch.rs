//! What the probes read of the syscall ABI of the architecture they are built for: the numbers of
//! the syscalls they follow and where `struct pt_regs` keeps the syscall number and arguments.
//! The one place that knows the architecture.
//!
//! `bpf_target_arch` is set by `aya-build` from the architecture the agent is built for (the
//! probes' own target is `bpfel-unknown-none` on both): `x86_64`, or `aarch64`. Everything else
//! refers to syscalls and arguments by their meaning ([`nr`], [`Arg`]).
//!
//! On `aarch64` a new task does not pass through `sys_exit` on its way out of `clone` (its first
//! return to user space, `ret_from_fork`, skips the syscall exit work), so only the parent's side
//! of a fork is seen there (`process::process_forked`): a child traced by pid alone
//! (`TRACETAP_TARGET_PIDS`, a pod selector) is traced from the moment its parent's `clone`
//! returns, not from its own first instruction; under the command-name filter nothing changes.
//!
//! Invariant: at `sys_exit` the arguments are still where the call found them, on both
//! architectures. On `x86_64` the return value goes to `ax`, not an argument register. On
//! `aarch64` it goes to `x0`, the first argument, so the first argument is read from `orig_x0`,
//! where the kernel keeps it for syscall restarts; `x1`..`x5` are left as they were.

/// Which syscall argument (0-based, as the C prototype numbers them).
#[derive(Copy, Clone)]
pub(crate) enum Arg {
    First,
    Second,
    Third,
    Fourth,
}

#[cfg(not(any(bpf_target_arch = "x86_64", bpf_target_arch = "aarch64")))]
compile_error!(
    "the probes know the syscall ABI of x86_64 and aarch64 only: build them through the agent (aya-build sets \
     bpf_target_arch from its target), or pass --cfg bpf_target_arch=\"x86_64\" or \"aarch64\""
);

#[cfg(bpf_target_arch = "x86_64")]
mod abi {
    use aya_ebpf::bindings::pt_regs;

    use super::Arg;

    /// `x86_64` syscall numbers of the calls we follow.
    pub(crate) mod nr {
        pub(crate) const READ: u64 = 0;
        pub(crate) const WRITE: u64 = 1;
        pub(crate) const CLOSE: u64 = 3;
        pub(crate) const READV: u64 = 19;
        pub(crate) const WRITEV: u64 = 20;
        pub(crate) const CONNECT: u64 = 42;
        pub(crate) const ACCEPT: u64 = 43;
        pub(crate) const SENDTO: u64 = 44;
        pub(crate) const RECVFROM: u64 = 45;
        pub(crate) const SENDMSG: u64 = 46;
        pub(crate) const RECVMSG: u64 = 47;
        pub(crate) const SPLICE: u64 = 275;
        pub(crate) const ACCEPT4: u64 = 288;
        pub(crate) const CLONE: u64 = 56;
        pub(crate) const CLONE3: u64 = 435;
        /// `fork` and `vfork`: `x86_64` has them; `aarch64` only has `clone`/`clone3`.
        pub(crate) const FORK: u64 = 57;
        pub(crate) const VFORK: u64 = 58;
    }

    /// Offsets in `x86_64`'s `struct pt_regs`: `orig_ax` (the syscall number), then the
    /// argument registers `di`, `si`, `dx`, `r10`.
    const ORIG_AX: usize = 120;
    const DI: usize = 112;
    const SI: usize = 104;
    const DX: usize = 96;
    const R10: usize = 56;

    #[inline(always)]
    pub(crate) fn syscall_nr(regs: u64) -> u64 {
        super::load_u64(regs, ORIG_AX)
    }

    #[inline(always)]
    pub(crate) fn arg_offset(arg: Arg) -> usize {
        match arg {
            Arg::First => DI,
            Arg::Second => SI,
            Arg::Third => DX,
            Arg::Fourth => R10,
        }
    }

    /// The return value register of a function call (`ax`), at a probe right after the call.
    #[inline(always)]
    pub(crate) fn call_result(regs: &pt_regs) -> u64 {
        regs.rax
    }

    /// Whether `nr` makes a new task (`clone`, `clone3`, `fork`, `vfork`).
    #[inline(always)]
    pub(crate) fn is_fork(nr: u64) -> bool {
        matches!(nr, nr::CLONE | nr::CLONE3 | nr::FORK | nr::VFORK)
    }
}

#[cfg(bpf_target_arch = "aarch64")]
mod abi {
    use aya_ebpf::bindings::pt_regs;

    use super::Arg;

    /// `aarch64` syscall numbers of the calls we follow (the generic table of
    /// `include/uapi/asm-generic/unistd.h`, without legacy calls such as `fork` or `open`).
    pub(crate) mod nr {
        pub(crate) const CLOSE: u64 = 57;
        pub(crate) const READ: u64 = 63;
        pub(crate) const WRITE: u64 = 64;
        pub(crate) const READV: u64 = 65;
        pub(crate) const WRITEV: u64 = 66;
        pub(crate) const SPLICE: u64 = 76;
        pub(crate) const ACCEPT: u64 = 202;
        pub(crate) const CONNECT: u64 = 203;
        pub(crate) const SENDTO: u64 = 206;
        pub(crate) const RECVFROM: u64 = 207;
        pub(crate) const SENDMSG: u64 = 211;
        pub(crate) const RECVMSG: u64 = 212;
        pub(crate) const CLONE: u64 = 220;
        pub(crate) const ACCEPT4: u64 = 242;
        pub(crate) const CLONE3: u64 = 435;
    }

    /// Offsets in `aarch64`'s `struct pt_regs`: `regs[31]`, `sp`, `pc`, `pstate`, then
    /// `orig_x0` (the first argument as the call found it) and `syscallno` (an `s32`).
    const ORIG_X0: usize = 272;
    const SYSCALLNO: usize = 280;

    #[inline(always)]
    pub(crate) fn syscall_nr(regs: u64) -> u64 {
        // `syscallno` is an `s32`: read as such (the verifier checks the load against the
        // field's BTF type); -1 (no syscall) becomes a number no call has.
        // SAFETY: see `super::load_u64`.
        let nr = unsafe { core::ptr::read_volatile((regs as usize + SYSCALLNO) as *const i32) };
        u64::from(nr as u32)
    }

    #[inline(always)]
    pub(crate) fn arg_offset(arg: Arg) -> usize {
        match arg {
            Arg::First => ORIG_X0,
            Arg::Second => 8,
            Arg::Third => 16,
            Arg::Fourth => 24,
        }
    }

    /// The return value register of a function call (`x0`), at a probe right after the call.
    #[inline(always)]
    pub(crate) fn call_result(regs: &pt_regs) -> u64 {
        regs.regs[0]
    }

    /// Whether `nr` makes a new task (`clone`, `clone3`).
    #[inline(always)]
    pub(crate) fn is_fork(nr: u64) -> bool {
        matches!(nr, nr::CLONE | nr::CLONE3)
    }
}

pub(crate) use abi::{call_result, is_fork, nr};

/// The number of the syscall whose saved registers `regs` are.
#[inline(always)]
pub(crate) fn syscall_nr(regs: u64) -> u64 {
    abi::syscall_nr(regs)
}

/// A syscall argument, from the saved registers `regs` (at `sys_enter` or `sys_exit`).
#[inline(always)]
pub(crate) fn arg(regs: u64, arg: Arg) -> u64 {
    load_u64(regs, abi::arg_offset(arg))
}

/// Reads a saved register. `regs` is the BTF-typed `struct pt_regs *` of a `tp_btf` program, so
/// this is a plain load the verifier checks against the kernel's BTF (and that faults safely),
/// not a helper call: the cheapest way to learn the syscall number on every syscall exit.
#[inline(always)]
fn load_u64(regs: u64, offset: usize) -> u64 {
    // SAFETY: see above; the offsets are those of this architecture's `struct pt_regs`.
    unsafe { core::ptr::read_volatile((regs as usize + offset) as *const u64) }
}
