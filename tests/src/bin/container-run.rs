//! Runs a program the way runc runs a Kubernetes container's process, for the tests that run the
//! agent exactly as its `DaemonSet` does: no Docker engine here, and a container is namespaces, a
//! root filesystem, capabilities and a seccomp filter.
//!
//! ```text
//! container-run --root DIR [--cgroup DIR] [--hostname NAME] [--bind SRC:DST[:rw]]...
//!               [--caps bpf,perfmon,...] [--seccomp PROFILE.json] -- PROGRAM ARGS...
//! ```
//!
//! In order, as runc does: enter `--cgroup` (a cgroup v2 directory), then new mount, UTS, IPC and
//! cgroup namespaces (pid and network stay the host's: `hostPID`, and the tests have no pod
//! network); the root bound on itself with `/proc` (a new procfs of the host pid namespace), `/sys`
//! read-only, a `/dev` tmpfs with the usual device nodes, and the `--bind` mounts (read-only
//! unless `:rw`); the root then remounted read-only (`readOnlyRootFilesystem`) and made `/` with
//! `pivot_root`; the hostname; the bounding set cut to `--caps` (uid 0 gains exactly those at
//! `execve`) and the inheritable set emptied; `no_new_privs`; the seccomp profile resolved for
//! those capabilities and loaded last, so that only `execve` runs under it before the program.
//! Any failure exits with status 125 and a message on stderr.

use std::ffi::{CString, OsStr};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use tracetap_tests::seccomp::{self, Profile};

struct Spec {
    root: PathBuf,
    cgroup: Option<PathBuf>,
    hostname: Option<String>,
    binds: Vec<(PathBuf, PathBuf, bool)>,
    caps: Vec<String>,
    seccomp: Option<PathBuf>,
    command: Vec<String>,
}

fn main() {
    // Every failure is the runner's, status 125, never a status the program could have exited with.
    std::panic::set_hook(Box::new(|info| fail(&info.to_string())));
    let spec = parse(std::env::args().skip(1).collect()).unwrap_or_else(|e| fail(&format!("usage: {e}")));
    if let Err(e) = run(&spec) {
        fail(&e);
    }
}

fn fail(message: &str) -> ! {
    eprintln!("container-run: {message}");
    std::process::exit(125)
}

fn parse(args: Vec<String>) -> Result<Spec, String> {
    let mut spec = Spec {
        root: PathBuf::new(),
        cgroup: None,
        hostname: None,
        binds: Vec::new(),
        caps: Vec::new(),
        seccomp: None,
        command: Vec::new(),
    };
    let mut args = args.into_iter();
    while let Some(flag) = args.next() {
        if flag == "--" {
            spec.command = args.collect();
            break;
        }
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--root" => spec.root = value.into(),
            "--cgroup" => spec.cgroup = Some(value.into()),
            "--hostname" => spec.hostname = Some(value),
            "--caps" => spec.caps = value.split(',').filter(|c| !c.is_empty()).map(str::to_owned).collect(),
            "--seccomp" => spec.seccomp = Some(value.into()),
            "--bind" => {
                let parts: Vec<&str> = value.split(':').collect();
                let (src, dst, rw) = match parts.as_slice() {
                    [src, dst] => (src, dst, false),
                    [src, dst, "rw"] => (src, dst, true),
                    _ => return Err(format!("--bind {value}: expected SRC:DST or SRC:DST:rw")),
                };
                spec.binds.push(((*src).into(), (*dst).into(), rw));
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if spec.root.as_os_str().is_empty() || spec.command.is_empty() {
        return Err("--root and a command after -- are required".into());
    }
    Ok(spec)
}

fn run(spec: &Spec) -> Result<(), String> {
    // Resolved before anything changes, against the capabilities the container keeps.
    let filter = spec.seccomp.as_deref().map(|path| {
        let caps: Vec<String> = spec.caps.iter().map(|c| format!("CAP_{}", c.to_uppercase())).collect();
        let caps: Vec<&str> = caps.iter().map(String::as_str).collect();
        Profile::read(path).resolve(&caps, seccomp::native_arch(), seccomp::kernel_version())
    });
    let keep = spec.caps.iter().map(|c| cap_number(c)).collect::<Result<Vec<u32>, String>>()?;
    if let Some(cgroup) = &spec.cgroup {
        std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
            .map_err(|e| format!("entering cgroup {}: {e}", cgroup.display()))?;
    }
    check(
        unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC | libc::CLONE_NEWCGROUP) },
        "unshare",
    )?;
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)?;
    let root = spec.root.canonicalize().map_err(|e| format!("root {}: {e}", spec.root.display()))?;
    mount(Some(&root), &root, None, libc::MS_BIND | libc::MS_REC, None)?;
    let inside = |p: &Path| resolve_in(&root, p);
    let nodev = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(Some(Path::new("proc")), &inside(Path::new("/proc")), Some("proc"), nodev, None)?;
    mount(Some(Path::new("sysfs")), &inside(Path::new("/sys")), Some("sysfs"), nodev | libc::MS_RDONLY, None)?;
    let dev = inside(Path::new("/dev"));
    mount(Some(Path::new("tmpfs")), &dev, Some("tmpfs"), libc::MS_NOSUID, Some("mode=755,size=65536k"))?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(node);
        std::fs::write(&target, b"").map_err(|e| format!("creating {}: {e}", target.display()))?;
        mount(Some(&Path::new("/dev").join(node)), &target, None, libc::MS_BIND, None)?;
    }
    std::fs::create_dir_all(dev.join("shm")).map_err(|e| format!("/dev/shm: {e}"))?;
    mount(Some(Path::new("shm")), &dev.join("shm"), Some("tmpfs"), nodev, Some("mode=1777,size=65536k"))?;
    for (src, dst, rw) in &spec.binds {
        let target = inside(dst);
        if src.is_dir() {
            std::fs::create_dir_all(&target).map_err(|e| format!("mount point {}: {e}", target.display()))?;
        } else if !target.exists() {
            std::fs::create_dir_all(target.parent().unwrap_or(&root))
                .map_err(|e| format!("{}: {e}", target.display()))?;
            std::fs::write(&target, b"").map_err(|e| format!("mount point {}: {e}", target.display()))?;
        }
        mount(Some(src), &target, None, libc::MS_BIND | libc::MS_REC, None)?;
        if !rw {
            mount(None, &target, None, libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY, None)?;
        }
    }
    // readOnlyRootFilesystem: the root's own mount only; /proc, /dev and the binds keep theirs.
    mount(None, &root, None, libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY, None)?;
    std::env::set_current_dir(&root).map_err(|e| format!("chdir {}: {e}", root.display()))?;
    let dot = CString::new(".").expect("no NUL");
    check(unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) }, "pivot_root")?;
    check(unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) }, "detaching the old root")?;
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;
    if let Some(name) = &spec.hostname {
        check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }, "sethostname")?;
    }
    drop_capabilities(&keep)?;
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) }, "no_new_privs")?;
    if let Some(filter) = filter {
        filter.apply().map_err(|e| format!("seccomp: {e}"))?;
    }
    let program = CString::new(spec.command[0].as_bytes()).map_err(|e| e.to_string())?;
    let c_args: Vec<CString> = spec.command.iter().map(|a| CString::new(a.as_bytes()).expect("no NUL")).collect();
    let mut argv: Vec<*const libc::c_char> = c_args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    unsafe { libc::execv(program.as_ptr(), argv.as_ptr()) };
    Err(format!("exec {}: {}", spec.command[0], std::io::Error::last_os_error()))
}

/// `path` inside `root` with the symbolic links on the way resolved inside `root` too (Debian's
/// `/var/run` is a link to `/run`: followed from the host, a mount point would land on the host's
/// `/run`), as runc's securejoin does. Components that do not exist yet are kept as they are.
fn resolve_in(root: &Path, path: &Path) -> PathBuf {
    let mut pending: Vec<std::ffi::OsString> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            std::path::Component::Normal(n) => Some(n.to_owned()),
            _ => None,
        })
        .collect();
    let mut resolved = PathBuf::new();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        let candidate = resolved.join(&part);
        match std::fs::read_link(root.join(&candidate)) {
            Ok(target) if hops < 40 => {
                hops += 1;
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                for c in target.components().rev() {
                    match c {
                        std::path::Component::Normal(n) => pending.push(n.to_owned()),
                        std::path::Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ if part == ".." => {
                resolved.pop();
            }
            _ => resolved = candidate,
        }
    }
    root.join(resolved)
}

/// Cuts the bounding set to `keep` and empties the inheritable and ambient sets: uid 0 then gets
/// exactly `keep` at `execve` (its file capabilities are the bounding set).
fn drop_capabilities(keep: &[u32]) -> Result<(), String> {
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .map_err(|e| format!("cap_last_cap: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("cap_last_cap: {e}"))?;
    for cap in (0..=last).filter(|c| !keep.contains(c)) {
        check(
            unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) },
            "dropping a capability",
        )?;
    }
    check(unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) }, "clearing ambient")?;
    // capget/capset v3: two 32-bit words per set.
    let mut header = CapHeader { version: 0x2008_0522, pid: 0 };
    let mut data = [CapData::default(); 2];
    check(unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) }, "capget")?;
    for d in &mut data {
        d.inheritable = 0;
    }
    check(unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) }, "capset")
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `bpf` → 39, as `capabilities(7)` numbers them.
fn cap_number(name: &str) -> Result<u32, String> {
    const NAMES: &[&str] = &[
        "chown",
        "dac_override",
        "dac_read_search",
        "fowner",
        "fsetid",
        "kill",
        "setgid",
        "setuid",
        "setpcap",
        "linux_immutable",
        "net_bind_service",
        "net_broadcast",
        "net_admin",
        "net_raw",
        "ipc_lock",
        "ipc_owner",
        "sys_module",
        "sys_rawio",
        "sys_chroot",
        "sys_ptrace",
        "sys_pacct",
        "sys_admin",
        "sys_boot",
        "sys_nice",
        "sys_resource",
        "sys_time",
        "sys_tty_config",
        "mknod",
        "lease",
        "audit_write",
        "audit_control",
        "setfcap",
        "mac_override",
        "mac_admin",
        "syslog",
        "wake_alarm",
        "block_suspend",
        "audit_read",
        "perfmon",
        "bpf",
        "checkpoint_restore",
    ];
    NAMES
        .iter()
        .position(|n| *n == name)
        .map(|i| u32::try_from(i).expect("small"))
        .ok_or_else(|| format!("unknown capability {name}"))
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), String> {
    let c = |s: &OsStr| CString::new(s.as_bytes()).expect("no NUL");
    let src_c = src.map(|s| c(s.as_os_str()));
    let target_c = c(target.as_os_str());
    let fstype_c = fstype.map(|s| c(OsStr::new(s)));
    let data_c = data.map(|s| c(OsStr::new(s)));
    let ret = unsafe {
        libc::mount(
            src_c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target_c.as_ptr(),
            fstype_c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            flags,
            data_c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr().cast()),
        )
    };
    check(
        ret,
        &format!("mounting {} on {}", src.map_or("(remount)".into(), |s| s.display().to_string()), target.display()),
    )
}

fn check(ret: impl Into<i64>, what: &str) -> Result<(), String> {
    if ret.into() < 0 { Err(format!("{what}: {}", std::io::Error::last_os_error())) } else { Ok(()) }
}
