//! Booting a Debian kernel under qemu with a Debian tree as its initramfs, and reading what the
//! guest prints on its serial console (the kernel matrix, `tests/tests/kernels.rs`).
//!
//! - **TCG, not KVM**: a KVM guest hangs under this machine's nesting; TCG boots one in ~15 s.
//!   TCG also runs an `arm64` guest ([`Machine::Aarch64`]), more slowly.
//! - **No disk, no modules**: the guest runs from its initramfs alone. Everything it needs (BPF,
//!   BTF, tracefs, cgroup2, loopback, the 8250 and PL011 serial consoles) is built into Debian's kernels, so
//!   only the kernel image is taken from its package (`scripts/vm_kernel.sh`), and no initramfs
//!   tooling runs.
//! - **Layers**: the initramfs is newc cpio archives concatenated; the kernel unpacks each over
//!   the last. A layer is a directory archived under its own name, or a tree archived as `/`.
//!   Directories are listed before what they hold (the kernel's unpacker creates no parents).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// One layer of an initramfs.
pub enum Layer<'a> {
    /// A tree unpacked as the guest's `/`.
    Root(&'a Path),
    /// A directory unpacked as `/NAME`, `NAME` being its file name.
    Under(&'a Path),
}

/// Writes the layers, in order, as one initramfs at `out`.
///
/// # Panics
/// When `find` or `cpio` cannot be run (run `make setup`) or fail.
pub fn initramfs(out: &Path, layers: &[Layer<'_>]) {
    let file = std::fs::File::create(out).expect("create the initramfs");
    for layer in layers {
        let (dir, what) = match layer {
            Layer::Root(root) => (root.to_path_buf(), PathBuf::from(".")),
            Layer::Under(dir) => (
                dir.parent().expect("a directory with a parent").to_path_buf(),
                PathBuf::from(dir.file_name().expect("a named directory")),
            ),
        };
        // -xdev: a tree's own mounts (a test's /proc inside it) are not archived.
        let status = Command::new("sh")
            .args(["-c", "find \"$1\" -xdev -print0 | cpio --null --create --format=newc --quiet", "sh"])
            .arg(&what)
            .current_dir(&dir)
            .stdout(file.try_clone().expect("initramfs file"))
            .status()
            .expect("run find and cpio (make setup installs cpio)");
        assert!(status.success(), "archiving {} failed: {status}", dir.join(&what).display());
    }
}

/// What a guest printed on its console (then what qemu printed on its standard error).
pub struct Console {
    pub lines: Vec<String>,
}

/// The machine a guest boots on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    /// A PC (`qemu-system-x86_64`), its console on the 8250 UART (`ttyS0`).
    X86_64,
    /// An `arm64` node: QEMU's `virt` board (`qemu-system-aarch64 -M virt`), its console on the
    /// PL011 UART (`ttyAMA0`). `-cpu max` with the cheap pointer-authentication algorithm: the
    /// architected one, emulated, makes every function return of Debian's code expensive under TCG.
    Aarch64,
}

impl Machine {
    /// The qemu program, the options that pick the board and CPU, and the console device.
    fn qemu(self) -> (&'static str, &'static [&'static str], &'static str) {
        match self {
            Self::X86_64 => ("qemu-system-x86_64", &["-cpu", "max"], "ttyS0"),
            Self::Aarch64 => ("qemu-system-aarch64", &["-M", "virt", "-cpu", "max,pauth-impdef=on"], "ttyAMA0"),
        }
    }
}

/// Boots `kernel` on `machine` with `initramfs`, running `init` (a path in it), with `args` added
/// to the kernel's command line (`NAME=value` words reach init as its environment). Waits until
/// the guest powers off, or kills it after `timeout`.
///
/// # Panics
/// When qemu cannot be run (run `make setup`).
#[must_use]
pub fn boot(machine: Machine, kernel: &Path, initramfs: &Path, init: &str, args: &str, timeout: Duration) -> Console {
    let (qemu, board, console) = machine.qemu();
    let mut child = Command::new(qemu)
        .args(["-accel", "tcg,thread=multi", "-smp", "2", "-m", "3072"])
        .args(board)
        .args(["-nodefaults", "-display", "none", "-serial", "stdio", "-no-reboot"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(format!("console={console} quiet panic=-1 rdinit={init} {args}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {qemu} (make setup installs qemu-system-x86 and qemu-system-arm): {e}"));
    // qemu's standard error is read as it comes, so that a chatty qemu never blocks on it.
    let stderr = child.stderr.take().expect("qemu's stderr");
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut text);
        text
    });
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("qemu's stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + timeout;
    let mut lines = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => lines.push(line.trim_end_matches('\r').to_owned()),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                break;
            }
        }
    }
    let _ = child.wait();
    let stderr = errors.join().unwrap_or_default();
    lines.extend(stderr.lines().map(|l| format!("qemu: {l}")));
    Console { lines }
}
