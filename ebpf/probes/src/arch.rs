//! What the probes read of `x86_64`'s syscall ABI: the numbers of the syscalls they follow and
//! where `struct pt_regs` keeps the syscall number and arguments. The one place that knows the
//! architecture.

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
    pub(crate) const FORK: u64 = 57;
    pub(crate) const VFORK: u64 = 58;
    pub(crate) const CLONE3: u64 = 435;
}

/// Offset of `dx` in `struct pt_regs` (`x86_64`).
pub(crate) const PT_REGS_DX: usize = 96;
/// Offset of `r10` (the fourth syscall argument) in `struct pt_regs` (`x86_64`).
pub(crate) const PT_REGS_R10: usize = 56;

/// Offset of `orig_ax` (the syscall number) in `struct pt_regs` (`x86_64`).
pub(crate) const PT_REGS_ORIG_AX: usize = 120;
/// Offsets of `si` and `di` (the second and first syscall arguments) in `struct pt_regs`.
pub(crate) const PT_REGS_SI: usize = 104;
pub(crate) const PT_REGS_DI: usize = 112;

/// Reads a saved register. `regs` is the BTF-typed `struct pt_regs *` of a `tp_btf` program, so
/// this is a plain load the verifier checks against the kernel's BTF (and that faults safely),
/// not a helper call: the cheapest way to learn the syscall number on every syscall exit.
#[inline(always)]
pub(crate) fn reg(regs: u64, offset: usize) -> u64 {
    // SAFETY: see above; the offsets are those of x86_64's `struct pt_regs`.
    unsafe { core::ptr::read_volatile((regs as usize + offset) as *const u64) }
}
