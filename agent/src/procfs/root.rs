//! Paths inside another process's root (`/proc/PID/root`), resolved as `openat2(2)` with
//! `RESOLVE_IN_ROOT` would resolve them: `..` stops at the root and symbolic links, absolute ones
//! included, resolve inside it (never on the agent's own file system), at most [`MAX_SYMLINKS`]
//! links and [`MAX_PATH_STEPS`] components per path. Every step is opened `O_PATH | O_NOFOLLOW`,
//! which never blocks, not even on a FIFO, and reads nothing: what the caller then reads, it
//! reopens through the descriptor ([`fd_path`]) after checking its kind on that descriptor.
//!
//! The walk is by hand, one `open` of `/proc/self/fd/N/NAME` per component, which any kernel
//! and any seccomp profile the agent runs under allows; `openat2` would do it in one call (a
//! possible next step, measured against these tests first).
//!
//! A process that `chroot`ed itself after it started (HAProxy's `chroot` directive) has the paths
//! it was given at start above its jail: [`start_root`] finds that root, and only where the
//! process's own `chroot` directive names the jail it is in ([`is_jail_of`]).

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Component, Path, PathBuf};

/// Path components walked to open one path, those of symbolic links included.
pub const MAX_PATH_STEPS: usize = 128;
/// Symbolic links followed to open one path (the kernel's own `MAXSYMLINKS`).
pub const MAX_SYMLINKS: usize = 40;

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

enum Step {
    Root,
    Up,
    Name(OsString),
}

fn push_steps(todo: &mut Vec<Step>, path: &Path) {
    let steps: Vec<Step> = path
        .components()
        .filter_map(|c| match c {
            Component::RootDir => Some(Step::Root),
            Component::ParentDir => Some(Step::Up),
            Component::Normal(name) => Some(Step::Name(name.to_owned())),
            Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    todo.extend(steps.into_iter().rev());
}

/// Opens `path` (as the process sees it) with `root` as `/`, the way `openat2(2)` with
/// `RESOLVE_IN_ROOT` would, using only `open` on `/proc/self/fd/N/NAME`: `..` stops at the root and
/// symbolic links, absolute ones too, resolve inside it. Each step is opened `O_PATH |
/// O_NOFOLLOW`: that never blocks (not on a FIFO either), never reads anything, and never follows a
/// link behind the walk's back. Returns an `O_PATH` descriptor of something that is not a link.
pub fn open_in_root(root: &File, path: &Path) -> io::Result<File> {
    // Directories walked below the root; the last one is where the walk is.
    let mut dirs: Vec<File> = Vec::new();
    let mut todo = Vec::new();
    push_steps(&mut todo, path);
    let (mut steps, mut links) = (0, 0);
    while let Some(step) = todo.pop() {
        let name = match step {
            Step::Root => {
                dirs.clear();
                continue;
            }
            Step::Up => {
                dirs.pop();
                continue;
            }
            Step::Name(name) => name,
        };
        steps += 1;
        if steps > MAX_PATH_STEPS {
            return Err(io::Error::other(format!("more than {MAX_PATH_STEPS} path components to walk")));
        }
        let at = fd_path(dirs.last().unwrap_or(root)).join(&name);
        let file = OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_NOFOLLOW).open(&at)?;
        let meta = file.metadata()?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            push_steps(&mut todo, &std::fs::read_link(&at)?);
        } else if meta.is_dir() {
            dirs.push(file);
        } else if todo.is_empty() {
            return Ok(file);
        } else {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
    }
    dirs.pop().map_or_else(|| root.try_clone(), Ok)
}
