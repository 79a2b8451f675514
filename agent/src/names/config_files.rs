//! The configuration of one traced process, read from its files: the `-f` arguments of its
//! command line, in the order HAProxy loads them, resolved in its root (or above its `chroot`
//! jail, see [`crate::procfs::root::start_root`]), with its own environment for `"${VAR}"` and its
//! root's `/etc/hosts` for `server` lines that give a hostname. Runs on a loader thread (see the
//! parent module), never on the capture thread.
//!
//! - Paths resolve inside the process's root as [`crate::procfs::root`] says: never on the
//!   agent's own file system, and no step blocks, not even on a FIFO.
//! - Only regular files are read: the kind is checked with `fstat` on the descriptor that is
//!   then read (reopened `O_NONBLOCK`, same device and inode), so there is no window between
//!   the check and the read. At most [`MAX_CONFIG_BYTES`] in all and [`MAX_CONFIG_FILES`] files
//!   per process, at most [`MAX_DIR_ENTRIES`] entries per directory; what the parser keeps is
//!   bounded too ([`tracetap_proxy::haproxy_config::MAX_NAMES_BYTES`]).
//! - One bad file does not spoil the others: the names of the files that could be read are
//!   kept. Each file that could not be read counts in `tracetap_config_read_errors_total`, and
//!   the process gets one warning naming the files and why.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read as _};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use tracetap_proxy::haproxy_config::ConfigParser;
use tracetap_proxy::haproxy_words::Environment;

use super::Outcome;
use crate::procfs::root::{above_jail, fd_path, is_jail_of, open_in_root, process_root};

/// Most configuration bytes read for one process, all its files together (so also for any one
/// file). HAProxy configurations are kilobytes, and even generated ones with thousands of
/// backends stay far below this; the cap bounds what a process pointing `-f` at a huge file makes
/// the agent read and hold (twice over at most, while parsing).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
/// Most paths opened for one process: `-f` arguments and `*.cfg` directory entries together,
/// whether they turn out readable or not (so that 10 000 `-f /dev/zero` cost 256 opens).
pub const MAX_CONFIG_FILES: usize = 256;
/// Problems kept for the warning (all are counted in the metric).
pub const MAX_PROBLEMS_KEPT: usize = 16;
/// Most entries looked at in one `-f` directory. Past it the whole directory is skipped: HAProxy
/// loads its `*.cfg` files in lexical order, and a partial listing has no order.
pub const MAX_DIR_ENTRIES: usize = 1024;
/// Bytes of `/proc/PID/cmdline` read: far more than any HAProxy command line.
pub const MAX_CMDLINE_BYTES: u64 = 128 << 10;
/// Bytes of `/proc/PID/environ` read (for `"${VAR}"` in the configuration); Linux caps a
/// process's arguments and environment together at a quarter of its stack limit.
pub const MAX_ENVIRON_BYTES: u64 = 2 << 20;
/// Bytes of the process root's `/etc/hosts` read (for `server` lines that give a hostname).
pub const MAX_HOSTS_BYTES: u64 = 1 << 20;

/// The configuration files of a command line, in the order HAProxy loads them: each `-f FILE`
/// (or `-fFILE`), and every argument after `--` (haproxy(1): "all the arguments following it
/// are config files").
#[must_use]
pub fn config_paths(cmdline: &[u8]) -> Vec<String> {
    let args: Vec<&str> = cmdline.split(|b| *b == 0).filter_map(|a| std::str::from_utf8(a).ok()).collect();
    let mut out = Vec::new();
    let mut i = 1;
    while i < args.len() {
        if args[i] == "--" {
            out.extend(args[i + 1..].iter().filter(|a| !a.is_empty()).map(|a| (*a).to_owned()));
            break;
        }
        if args[i] == "-f" {
            if let Some(p) = args.get(i + 1) {
                out.push((*p).to_owned());
            }
            i += 2;
            continue;
        }
        if let Some(p) = args[i].strip_prefix("-f").filter(|p| !p.is_empty()) {
            out.push(p.to_owned());
        }
        i += 1;
    }
    out
}

/// Reads and parses the configuration of process `pid` (run on a loader thread).
pub(super) fn load(proc_root: &Path, pid: u32) -> Outcome {
    let pid_dir = proc_root.join(pid.to_string());
    let mut cmdline = Vec::new();
    if let Err(e) =
        File::open(pid_dir.join("cmdline")).and_then(|f| f.take(MAX_CMDLINE_BYTES).read_to_end(&mut cmdline))
    {
        return Outcome::failed(format!("reading cmdline: {e}"));
    }
    let paths = config_paths(&cmdline);
    if paths.is_empty() {
        return Outcome::failed("no -f argument on the command line".into());
    }
    // The process's own environment, for `"${VAR}"` in its configuration. Unreadable: variables
    // expand to nothing, as an unset one would (the names they give are then not found).
    let mut environ = Vec::new();
    let _ = File::open(pid_dir.join("environ")).and_then(|f| f.take(MAX_ENVIRON_BYTES).read_to_end(&mut environ));
    let cwd = std::fs::read_link(pid_dir.join("cwd")).unwrap_or_else(|_| PathBuf::from("/"));
    let process_root = match process_root(proc_root, pid) {
        Ok(root) => root,
        Err(e) => return Outcome::failed(format!("opening the process's root: {e}")),
    };
    // A process that `chroot`ed itself has its configuration above its jail: read from there,
    // and kept only if the configuration's own `chroot` says that jail is the process's root.
    let first = if Path::new(&paths[0]).is_absolute() { PathBuf::from(&paths[0]) } else { cwd.join(&paths[0]) };
    let above = if open_in_root(&process_root, &first).is_ok() { None } else { above_jail(&process_root, &first) };
    let jailed = above.is_some();
    let root = match above.map_or_else(|| process_root.try_clone(), Ok) {
        Ok(root) => root,
        Err(e) => return Outcome::failed(format!("opening the process's root: {e}")),
    };
    let mut reader = Reader {
        root,
        parser: ConfigParser::with_environment(Environment::from_environ(&environ)),
        bytes_left: MAX_CONFIG_BYTES,
        paths: 0,
        read_any: false,
        problems: Vec::new(),
        problem_count: 0,
    };
    for p in paths {
        let inside = if Path::new(&p).is_absolute() { PathBuf::from(&p) } else { cwd.join(&p) };
        reader.argument(&inside);
    }
    let Reader { root, parser, read_any, mut problems, mut problem_count, .. } = reader;
    let mut names = read_any.then(|| parser.finish());
    if jailed
        && names.as_ref().is_some_and(|n| !n.chroot.as_deref().is_some_and(|dir| is_jail_of(&root, dir, &process_root)))
    {
        problems.push(format!(
            "{} is not in the process's root; a configuration above it names no `chroot` that is the process's root, so it is not used",
            first.display()
        ));
        problem_count += 1;
        names = None;
    }
    let names = names.map(|mut names| {
        if !names.fd_binds.is_empty() {
            // `bind fd@N`: the socket the process was given as descriptor N says its address.
            names.resolve_fd_binds(|fd| crate::procfs::sockets::socket_addr(proc_root, pid, fd));
        }
        if !names.host_servers.is_empty() {
            // Hostnames as the process resolved them at start, from its own root's /etc/hosts
            // (unreadable: they stay unnamed, counted as skipped lines).
            let hosts = read_hosts(&root);
            names.resolve_hosts(|h| hosts.get(h).copied());
        }
        names
    });
    Outcome { names, problems, problem_count }
}

/// `/etc/hosts` inside the process's root, at most [`MAX_HOSTS_BYTES`] of it.
fn read_hosts(root: &File) -> HashMap<String, std::net::IpAddr> {
    let mut text = Vec::new();
    let read = open_in_root(root, Path::new("/etc/hosts")).and_then(|f| {
        // Reopened for reading through the O_PATH descriptor, non-blocking (a FIFO there must not hang).
        let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(fd_path(&f))?;
        if !file.metadata()?.is_file() {
            return Err(io::Error::other("not a regular file"));
        }
        file.take(MAX_HOSTS_BYTES).read_to_end(&mut text)
    });
    match read {
        Ok(_) => super::hosts::parse_hosts(&String::from_utf8_lossy(&text)),
        Err(_) => HashMap::new(),
    }
}

/// The files of one process's configuration, read within the limits.
struct Reader {
    /// The process's root directory (`O_PATH`).
    root: File,
    parser: ConfigParser,
    bytes_left: u64,
    /// Paths opened, against [`MAX_CONFIG_FILES`].
    paths: usize,
    read_any: bool,
    problems: Vec<String>,
    problem_count: usize,
}

impl Reader {
    /// One `-f` argument: a file, or the `*.cfg` files of a directory in lexical order (as HAProxy
    /// loads them).
    fn argument(&mut self, path: &Path) {
        match self.open(path) {
            Some((meta, dir)) if meta.is_dir() => self.directory(path, &dir),
            Some((meta, file)) => self.file(path, &file, &meta),
            None => {}
        }
    }

    /// Opens `path` inside the root (`O_PATH`), counted against [`MAX_CONFIG_FILES`]; `None`, with
    /// the problem noted, when it cannot be.
    fn open(&mut self, path: &Path) -> Option<(std::fs::Metadata, File)> {
        if self.paths >= MAX_CONFIG_FILES {
            self.problem(path, &format!("more than {MAX_CONFIG_FILES} files: not read"));
            return None;
        }
        self.paths += 1;
        match open_in_root(&self.root, path).and_then(|f| Ok((f.metadata()?, f))) {
            Ok(opened) => Some(opened),
            Err(e) => {
                self.problem(path, &e.to_string());
                None
            }
        }
    }

    fn directory(&mut self, path: &Path, dir: &File) {
        let entries = match std::fs::read_dir(fd_path(dir)) {
            Ok(entries) => entries,
            Err(e) => return self.problem(path, &e.to_string()),
        };
        let mut names: Vec<OsString> = Vec::new();
        for (n, entry) in entries.enumerate() {
            if n >= MAX_DIR_ENTRIES {
                return self.problem(path, &format!("more than {MAX_DIR_ENTRIES} entries: directory skipped"));
            }
            match entry {
                Ok(entry) => {
                    let name = entry.file_name();
                    if Path::new(&name).extension().is_some_and(|e| e == "cfg") {
                        names.push(name);
                    }
                }
                Err(e) => return self.problem(path, &format!("listing it: {e}")),
            }
        }
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for name in names {
            let file = path.join(name);
            if let Some((meta, f)) = self.open(&file) {
                self.file(&file, &f, &meta);
            }
        }
    }

    /// `file` is an `O_PATH` descriptor of something that is not a symbolic link.
    fn file(&mut self, path: &Path, file: &File, meta: &std::fs::Metadata) {
        if !meta.is_file() {
            return self.problem(path, &format!("not a regular file but {}", kind(meta)));
        }
        if meta.len() > self.bytes_left {
            let left = self.bytes_left;
            return self.problem(
                path,
                &format!(
                    "{} bytes: over the cap of {MAX_CONFIG_BYTES} configuration bytes per process ({left} left)",
                    meta.len()
                ),
            );
        }
        match self.read(file, meta) {
            Ok(text) => {
                self.parser.add_file(&String::from_utf8_lossy(&text));
                self.read_any = true;
            }
            Err(e) => self.problem(path, &e.to_string()),
        }
    }

    /// Reads a regular file through a new descriptor, checked to be the same regular file.
    fn read(&mut self, file: &File, meta: &std::fs::Metadata) -> io::Result<Vec<u8>> {
        let readable =
            OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(fd_path(file))?;
        let now = readable.metadata()?;
        if !now.is_file() || (now.dev(), now.ino()) != (meta.dev(), meta.ino()) {
            return Err(io::Error::other("replaced while being opened"));
        }
        let mut text = Vec::with_capacity(now.len().min(self.bytes_left) as usize);
        readable.take(self.bytes_left + 1).read_to_end(&mut text)?;
        if text.len() as u64 > self.bytes_left {
            return Err(io::Error::other(format!("grew past the {MAX_CONFIG_BYTES}-byte cap while being read")));
        }
        self.bytes_left -= text.len() as u64;
        Ok(text)
    }

    fn problem(&mut self, path: &Path, why: &str) {
        self.problem_count += 1;
        if self.problems.len() < MAX_PROBLEMS_KEPT {
            self.problems.push(format!("{}: {why}", path.display()));
        }
    }
}

fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_dir() {
        "a directory"
    } else {
        "something else"
    }
}
