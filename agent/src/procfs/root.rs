//! Paths inside another process's root (`/proc/PID/root`), resolved by `openat2(2)` with
//! `RESOLVE_IN_ROOT` ([`open_in_root`]): `..` stops at the root and symbolic links, absolute ones
//! included, resolve inside it (never on the agent's own file system). What is opened is opened
//! `O_PATH`, which never blocks, not even on a FIFO, and reads nothing: what the caller then
//! reads, it reopens through the descriptor ([`fd_path`]) after checking its kind on that
//! descriptor. (`openat2` is Linux 5.6+, older than the agent's own floor, and in every seccomp
//! profile that lets the agent load its probes.)
//!
//! A process that `chroot`ed itself after it started (HAProxy's `chroot` directive) has the paths
//! it was given at start above its jail: [`start_root`] finds that root, and only where the
//! process's own `chroot` directive names the jail it is in ([`is_jail_of`]).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// `/proc/PID/root` (`O_PATH`).
pub fn process_root(proc_root: &Path, pid: u32) -> io::Result<File> {
    open_dir(&proc_root.join(pid.to_string()).join("root"))
}

/// Opens directory `path` `O_PATH`: to walk from, never to read.
fn open_dir(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_DIRECTORY).open(path)
}

/// The nearest directory above `root` (the jail of a process that `chroot`ed itself), within
/// the process's mount namespace, where `probe` exists: a candidate for the root the process
/// started in. Only a candidate: [`is_jail_of`] must confirm it against the process's own
/// `chroot` directive, or a process confined by someone else could have the agent read above
/// its confinement.
#[must_use]
pub fn above_jail(root: &File, probe: &Path) -> Option<File> {
    super::jail::above(&fd_path(root))
        .iter()
        .filter_map(|dir| open_dir(dir).ok())
        .find(|dir| open_in_root(dir, probe).is_ok())
}

/// Whether `chroot` (the process's `chroot` directive) under `start` is the process's `root`.
#[must_use]
pub fn is_jail_of(start: &File, chroot: &str, root: &File) -> bool {
    let (Ok(jail), Ok(root)) = (open_in_root(start, Path::new(chroot)).and_then(|j| j.metadata()), root.metadata())
    else {
        return false;
    };
    (jail.dev(), jail.ino()) == (root.dev(), root.ino())
}

/// The root process `pid` started in, where a path it was given at start resolves (`probe`:
/// its stats socket): `/proc/PID/root`, unless its configuration's `chroot` directive (`chroot`)
/// moved it into a jail after it started (Debian's packaged configuration has `chroot
/// /var/lib/haproxy`) and `probe` is not in the jail: then the directory above the jail that
/// holds `probe` and of which `chroot` is the jail. Otherwise `/proc/PID/root`, so that the
/// caller's own error says what is missing.
pub fn start_root(proc_root: &Path, pid: u32, probe: &Path, chroot: Option<&str>) -> io::Result<File> {
    let root = process_root(proc_root, pid)?;
    let Some(chroot) = chroot else { return Ok(root) };
    if open_in_root(&root, probe).is_ok() {
        return Ok(root);
    }
    match above_jail(&root, probe) {
        Some(start) if is_jail_of(&start, chroot, &root) => Ok(start),
        _ => Ok(root),
    }
}

/// The path of an open descriptor, to open what it names again or to look under it.
#[must_use]
pub fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// Opens `path` (as the process sees it) with `root` as `/`: `openat2(2)` with `RESOLVE_IN_ROOT`,
/// so `..` stops at the root and symbolic links, absolute ones too, resolve inside it, in the
/// kernel, with its own limit of links; magic links (`/proc/PID/fd/N` and the like, which could
/// lead out of the root) are refused. Opened `O_PATH`: that never blocks (not on a FIFO either)
/// and reads nothing. Returns an `O_PATH` descriptor of what the path names, its last link
/// followed.
pub fn open_in_root(root: &File, path: &Path) -> io::Result<File> {
    use rustix::fs::{Mode, OFlags, ResolveFlags, openat2};
    // The kernel says EAGAIN when a rename elsewhere raced the walk (it cannot then vouch for
    // `..`); another try walks again.
    for _ in 0..RACE_RETRIES {
        match openat2(
            root,
            path,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        ) {
            Ok(fd) => return Ok(File::from(fd)),
            Err(rustix::io::Errno::AGAIN) => {}
            // Only a seccomp profile refuses `openat2` this way on the kernels the agent runs on.
            Err(errno @ (rustix::io::Errno::PERM | rustix::io::Errno::NOSYS)) => {
                return Err(io::Error::new(
                    io::Error::from(errno).kind(),
                    format!(
                        "openat2 refused ({errno}): the agent's seccomp profile must allow openat2, as containerd's and Docker's defaults do"
                    ),
                ));
            }
            Err(errno) => return Err(errno.into()),
        }
    }
    Err(io::Error::from_raw_os_error(libc::EAGAIN))
}

/// Tries of [`open_in_root`] when renames keep racing it.
const RACE_RETRIES: usize = 8;
