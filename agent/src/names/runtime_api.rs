//! Reading a traced `HAProxy`'s live server table through its runtime API (`stats socket`).
//!
//! - One line only, `show info;show servers state`: read-only commands, which change nothing in
//!   `HAProxy`. `show info` names the answering process: after a reload the path leads to the new
//!   process, and the old one's table is not read from it ([`RuntimeApiError::OtherProcess`]).
//! - The socket path is the process's, resolved inside its root (`/proc/PID/root`) the way its
//!   configuration files are ([`crate::procfs::root::open_in_root`]), so it works for `HAProxy` in containers;
//!   the connection goes through `/proc/self/fd/N` of that `O_PATH` descriptor, which also spares
//!   the 108-byte limit of a socket path.
//! - Connecting to a unix socket needs write permission on it. The agent's four capabilities do
//!   not include `CAP_DAC_OVERRIDE`, so a socket that root (uid 0) may not write is refused: the
//!   error says so and what to change.
//! - Runs on a loader thread, never on the capture thread; the socket has a deadline for every
//!   read and write, and the answer is capped at [`MAX_ANSWER_BYTES`].

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::FileTypeExt as _;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use tracetap_proxy::haproxy_runtime::{
    SHOW_SERVERS_STATE, ServersState, StateError, parse_servers_state, split_answer,
};

use crate::procfs::root::{fd_path, open_in_root, start_root};

/// Most bytes of one answer read: 100 000 servers of ~100 bytes each fit.
pub const MAX_ANSWER_BYTES: u64 = 16 << 20;

/// Why the table could not be read. The message names the socket and what an operator can do.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeApiError {
    #[error("the stats socket {path} cannot be opened in the process's root: {source}")]
    Open { path: String, source: io::Error },
    #[error("{path} is not a unix socket")]
    NotASocket { path: String },
    #[error(
        "the stats socket {path} refuses the agent: {source}. Connecting to a unix socket needs write permission \
         on it, and the agent's capabilities (CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH) do not \
         override file permissions: give the `stats socket` line `mode 666`, or a `uid`/`gid` the agent runs as, \
         or set TRACETAP_HAPROXY_RUNTIME_API=false. Server names come from the configuration file meanwhile"
    )]
    Denied { path: String, source: io::Error },
    #[error(
        "nothing answers on the stats socket {path}: {source} (a socket file left by an earlier process?); \
         server names come from the configuration file meanwhile"
    )]
    Connect { path: String, source: io::Error },
    #[error("reading the stats socket {path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("the stats socket {path} answered more than {MAX_ANSWER_BYTES} bytes")]
    TooLong { path: String },
    #[error("the stats socket {path}: {source}")]
    Answer { path: String, source: StateError },
    /// Not a failure: after a reload the path leads to the new process's socket, whose table is
    /// not this process's.
    #[error("the stats socket {path} belongs to another process now (it answers as pid {answered})")]
    OtherProcess { path: String, answered: u32 },
}

impl RuntimeApiError {
    /// A short reason for the metric's label.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Open { .. } | Self::NotASocket { .. } => "not_found",
            Self::Denied { .. } => "permission_denied",
            Self::Connect { .. } => "refused",
            Self::Io { .. } | Self::TooLong { .. } => "io",
            Self::Answer { .. } => "bad_answer",
            Self::OtherProcess { .. } => "other_process",
        }
    }
}

/// Sends `show info;show servers state` on the stats socket at `path` (as process `pid` sees it)
/// and parses the answer, checking that `pid` is the process that answered. Gives up when
/// `timeout` has passed (the connect included).
///
/// # Errors
/// See [`RuntimeApiError`].
pub fn read_servers_state(
    proc_root: &Path,
    pid: u32,
    path: &str,
    chroot: Option<&str>,
    timeout: Duration,
) -> Result<ServersState, RuntimeApiError> {
    let deadline = Instant::now() + timeout;
    // The socket was made before any `chroot` (the configuration's, `chroot`): it lives in the
    // root the process started in.
    let root = start_root(proc_root, pid, Path::new(path), chroot)
        .map_err(|source| RuntimeApiError::Open { path: path.to_owned(), source })?;
    let socket: File = open_in_root(&root, Path::new(path))
        .map_err(|source| RuntimeApiError::Open { path: path.to_owned(), source })?;
    let is_socket = socket.metadata().is_ok_and(|m| m.file_type().is_socket());
    if !is_socket {
        return Err(RuntimeApiError::NotASocket { path: path.to_owned() });
    }
    let mut stream = connect(&socket, deadline).map_err(|source| {
        if source.kind() == io::ErrorKind::PermissionDenied {
            RuntimeApiError::Denied { path: path.to_owned(), source }
        } else {
            RuntimeApiError::Connect { path: path.to_owned(), source }
        }
    })?;
    let io_err = |source| RuntimeApiError::Io { path: path.to_owned(), source };
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left())).map_err(io_err)?;
    stream.write_all(SHOW_SERVERS_STATE.as_bytes()).map_err(io_err)?;
    // HAProxy closes the connection after answering a command sent without `prompt`.
    let mut answer = Vec::new();
    let mut buf = vec![0u8; 16 << 10];
    loop {
        if Instant::now() >= deadline {
            return Err(io_err(io::Error::from(io::ErrorKind::TimedOut)));
        }
        stream.set_read_timeout(Some(left())).map_err(io_err)?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if answer.len() as u64 + n as u64 > MAX_ANSWER_BYTES {
                    return Err(RuntimeApiError::TooLong { path: path.to_owned() });
                }
                answer.extend_from_slice(&buf[..n]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    let (answered, table) = split_answer(&answer);
    // The process as it sees itself (its own pid namespace): what `show info` says.
    if let (Some(answered), Some(own)) = (answered, namespace_pid(proc_root, pid))
        && answered != own
    {
        return Err(RuntimeApiError::OtherProcess { path: path.to_owned(), answered });
    }
    parse_servers_state(table).map_err(|source| RuntimeApiError::Answer { path: path.to_owned(), source })
}

/// Connects to the socket behind `socket` (an `O_PATH` descriptor), giving up at `deadline`: a
/// listener whose backlog is full (a stopped process, or one that never accepts) would otherwise
/// block the connect for good.
fn connect(socket: &File, deadline: Instant) -> io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketType, sockopt};
    let fd = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    sockopt::set_socket_timeout(&fd, sockopt::Timeout::Send, Some(left))?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(fd_path(socket))?)?;
    Ok(UnixStream::from(fd))
}

/// Process `pid`'s id in its own pid namespace (the last `NSpid` of its status).
fn namespace_pid(proc_root: &Path, pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_ascii_whitespace().last()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    /// A fake `/proc` whose process `pid` has `root` as its root directory.
    fn fake_proc(dir: &Path, pid: u32, root: &Path) -> std::path::PathBuf {
        let proc_root = dir.join("proc");
        std::fs::create_dir_all(proc_root.join(pid.to_string())).unwrap();
        std::os::unix::fs::symlink(root, proc_root.join(pid.to_string()).join("root")).unwrap();
        proc_root
    }

    #[test]
    fn reads_the_table_through_the_process_root_and_sends_only_the_read_command() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        // A long path inside the root: longer than a socket address can hold from outside it.
        let deep = root.join("run").join("x".repeat(100));
        std::fs::create_dir_all(&deep).unwrap();
        // Bound through the directory's descriptor: the full path is too long for a socket address.
        let dir_fd = File::open(&deep).unwrap();
        let listener = UnixListener::bind(fd_path(&dir_fd).join("admin.sock")).unwrap();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut command = [0u8; 64];
            let n = conn.read(&mut command).unwrap();
            conn.write_all(b"1\n# be_id be_name srv_id srv_name srv_addr srv_port\n3 be 1 s1 10.1.2.3 8080\n").unwrap();
            String::from_utf8_lossy(&command[..n]).into_owned()
        });
        let proc_root = fake_proc(dir.path(), 42, &root);
        let path = format!("/run/{}/admin.sock", "x".repeat(100));
        let state = read_servers_state(&proc_root, 42, &path, None, Duration::from_secs(5)).unwrap();
        assert_eq!(state.servers.len(), 1);
        assert_eq!(state.servers[0].server, "s1");
        assert_eq!(server.join().unwrap(), "show info;show servers state\n");
    }

    #[test]
    fn a_socket_another_process_answers_is_not_read_as_this_ones() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        std::fs::create_dir_all(&root).unwrap();
        let listener = UnixListener::bind(root.join("admin.sock")).unwrap();
        std::thread::spawn(move || {
            for answering in [9, 7] {
                let (mut conn, _) = listener.accept().unwrap();
                let _ = conn.read(&mut [0u8; 64]);
                let table = "1\n# be_name srv_name srv_addr srv_port\nbe s1 10.1.2.3 8080\n";
                let _ = conn.write_all(format!("Name: HAProxy\nPid: {answering}\n\n{table}").as_bytes());
            }
        });
        let proc_root = fake_proc(dir.path(), 42, &root);
        // Host pid 42 is pid 7 in its container.
        std::fs::write(proc_root.join("42/status"), "Name:\thaproxy\nNSpid:\t42\t7\n").unwrap();
        let read = || read_servers_state(&proc_root, 42, "/admin.sock", None, Duration::from_secs(5));
        assert_eq!(read().unwrap_err().reason(), "other_process", "pid 9 answered");
        assert_eq!(read().unwrap().servers.len(), 1, "pid 7 answered");
    }

    #[test]
    fn a_listener_that_never_accepts_does_not_hang_the_connect() {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        std::fs::create_dir_all(&root).unwrap();
        let listener = rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
        rustix::net::bind(&listener, &SocketAddrUnix::new(root.join("full.sock")).unwrap()).unwrap();
        rustix::net::listen(&listener, 0).unwrap();
        // Fill the backlog with connections nobody accepts.
        let mut queued = Vec::new();
        loop {
            let c =
                rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::NONBLOCK, None).unwrap();
            if rustix::net::connect(&c, &SocketAddrUnix::new(root.join("full.sock")).unwrap()).is_err() {
                break;
            }
            queued.push(c);
        }
        let proc_root = fake_proc(dir.path(), 5, &root);
        let e = read_servers_state(&proc_root, 5, "/full.sock", None, Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.reason(), "refused", "{e}");
        drop(queued);
    }

    #[test]
    fn failures_name_the_socket_and_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        std::fs::create_dir_all(root.join("run")).unwrap();
        std::fs::write(root.join("run/file"), b"").unwrap();
        // A socket file nobody listens on any more.
        drop(UnixListener::bind(root.join("run/stale.sock")).unwrap());
        let proc_root = fake_proc(dir.path(), 7, &root);
        let read = |p: &str| read_servers_state(&proc_root, 7, p, None, Duration::from_secs(1)).unwrap_err();
        assert_eq!(read("/run/missing.sock").reason(), "not_found");
        assert_eq!(read("/run/file").reason(), "not_found");
        let stale = read("/run/stale.sock");
        assert_eq!(stale.reason(), "refused");
        assert!(stale.to_string().contains("/run/stale.sock"), "{stale}");
    }

    #[test]
    fn a_peer_that_never_answers_or_answers_junk_is_given_up() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        std::fs::create_dir_all(&root).unwrap();
        let silent = UnixListener::bind(root.join("silent.sock")).unwrap();
        let junk = UnixListener::bind(root.join("junk.sock")).unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = junk.accept().unwrap();
            let _ = conn.read(&mut [0u8; 64]);
            let _ = conn.write_all(b"Unknown command. Please enter one of the following commands only :\n");
        });
        let proc_root = fake_proc(dir.path(), 9, &root);
        let e = read_servers_state(&proc_root, 9, "/silent.sock", None, Duration::from_millis(200)).unwrap_err();
        assert_eq!(e.reason(), "io");
        drop(silent);
        let e = read_servers_state(&proc_root, 9, "/junk.sock", None, Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.reason(), "bad_answer");
    }
}
