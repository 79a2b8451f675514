//! Where a traced process keeps its TLS library: the files it maps that may export `SSL_read`,
//! `SSL_write` and `SSL_do_handshake` (a shared `libssl`, or the program itself when it links
//! `OpenSSL`, `AWS-LC` or `BoringSSL` statically), as paths the agent can open from its own mount
//! namespace (through `/proc/PID/root`, so a process in a container is covered).
//!
//! Where in those files to attach ([`attach_plan`]): the cheapest probe points the code allows.
//! A probe at a function's entry makes the kernel single-step the first instruction out of line,
//! a debug exception per call that costs microseconds in a virtual machine (measured here: half
//! of a TLS-terminating `HAProxy`'s CPU). Calls and conditional jumps are emulated instead, so on
//! a build whose `SSL_read`/`SSL_write` the agent recognises (OpenSSL 3 as GCC compiles it:
//! the prologue, then `call ssl_{read,write}_internal(s, buf, num, &bytes)`, `test eax,eax`,
//! `jle`) the probes go on that call and on that jump. Recognition is by exact bytes from the
//! function's start, so a probe never lands inside an instruction; any other build gets the entry
//! and return probes.
//!
//! The probes themselves are attached by [`super::loader::Probes::hook_tls`], one set per process
//! (never for every process that maps the same library: other programs on the node must not pay a
//! uprobe per TLS call), and detached when the process goes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

use procfs_core::FromBufRead as _;
use procfs_core::process::{MMPermissions, MMapPath, MemoryMaps};

/// A function probed: its symbol, its entry and return programs, and its call-site programs (see
/// the module notes). The handshake is probed so that a connection is bound to its socket before
/// its first plaintext (see the probes' `tls` module); it runs once per connection, so its entry
/// probe's cost does not matter.
struct Function {
    symbol: &'static str,
    entry: &'static str,
    ret: &'static str,
    call_site: Option<(&'static str, &'static str)>,
}

const FUNCTIONS: [Function; 3] = [
    Function {
        symbol: "SSL_read",
        entry: "ssl_read_entry",
        ret: "ssl_read_return",
        call_site: Some(("ssl_read_call", "ssl_read_done")),
    },
    Function {
        symbol: "SSL_write",
        entry: "ssl_write_entry",
        ret: "ssl_write_return",
        call_site: Some(("ssl_write_call", "ssl_write_done")),
    },
    Function { symbol: "SSL_do_handshake", entry: "ssl_handshake_entry", ret: "ssl_handshake_return", call_site: None },
];

/// Every program the TLS probes use (the agent loads them all at start), the floor's last.
pub const PROGRAMS: [&str; 12] = [
    "ssl_read_entry",
    "ssl_read_return",
    "ssl_read_call",
    "ssl_read_done",
    "ssl_write_entry",
    "ssl_write_return",
    "ssl_write_call",
    "ssl_write_done",
    "ssl_handshake_entry",
    "ssl_handshake_return",
    FLOOR_PROGRAM,
    FLOOR_RETURN_PROGRAM,
];

/// What `TRACETAP_PROBE_MODE=floor` attaches at every point of a plan instead of its program:
/// programs that return at once, so that the benchmark measures the uprobe traps alone.
pub const FLOOR_PROGRAM: &str = "ssl_floor";
/// The floor's program for the points of a plan that are return probes (`*_return`).
pub const FLOOR_RETURN_PROGRAM: &str = "ssl_floor_return";

/// The program the floor attaches in place of `program`: a return probe (a function's `ret`
/// program) stays a return probe.
#[must_use]
pub fn floor_twin(program: &str) -> &'static str {
    if FUNCTIONS.iter().any(|f| f.ret == program) { FLOOR_RETURN_PROGRAM } else { FLOOR_PROGRAM }
}

/// A function prologue the agent recognises: its bytes up to and including the internal call's
/// `test eax,eax; jle` (`None`: any byte, the displacements), where the call and the jump are,
/// and which argument of the internal call points at the byte count (the attach cookie of the
/// call-site program, see the probes' `tls` module).
struct Template {
    bytes: &'static [Option<u8>],
    call_at: u64,
    jump_at: u64,
    count_arg: u64,
}

/// `SSL_read` and `SSL_write` of OpenSSL 3.0/3.1 as GCC builds them (Debian 12), and `SSL_read`
/// of 3.2+ (Debian 13): `call ssl_{read,write}_internal(s, buf, num, &bytes)`.
#[rustfmt::skip]
const OPENSSL3_0: [Option<u8>; 39] = [
    Some(0x48), Some(0x83), Some(0xec), Some(0x18), // sub $0x18,%rsp
    Some(0x64), Some(0x48), Some(0x8b), Some(0x04), Some(0x25), Some(0x28), Some(0x00), Some(0x00), Some(0x00), // mov %fs:0x28,%rax
    Some(0x48), Some(0x89), Some(0x44), Some(0x24), Some(0x08), // mov %rax,0x8(%rsp)
    Some(0x31), Some(0xc0), // xor %eax,%eax
    Some(0x85), Some(0xd2), // test %edx,%edx
    Some(0x78), None, // js
    Some(0x48), Some(0x89), Some(0xe1), // mov %rsp,%rcx: &bytes, the fourth argument
    Some(0x48), Some(0x63), Some(0xd2), // movslq %edx,%rdx
    Some(0xe8), None, None, None, None, // call <internal>
    Some(0x85), Some(0xc0), // test %eax,%eax
    Some(0x7e), None, // jle
];

/// `SSL_write` of OpenSSL 3.2+ (Debian 13): `call ssl_write_internal(s, buf, num, 0, &written)`.
#[rustfmt::skip]
const OPENSSL3_2_WRITE: [Option<u8>; 41] = [
    Some(0x48), Some(0x83), Some(0xec), Some(0x18), // sub $0x18,%rsp
    Some(0x64), Some(0x48), Some(0x8b), Some(0x04), Some(0x25), Some(0x28), Some(0x00), Some(0x00), Some(0x00), // mov %fs:0x28,%rax
    Some(0x48), Some(0x89), Some(0x44), Some(0x24), Some(0x08), // mov %rax,0x8(%rsp)
    Some(0x31), Some(0xc0), // xor %eax,%eax
    Some(0x85), Some(0xd2), // test %edx,%edx
    Some(0x78), None, // js
    Some(0x31), Some(0xc9), // xor %ecx,%ecx: flags 0
    Some(0x48), Some(0x63), Some(0xd2), // movslq %edx,%rdx
    Some(0x49), Some(0x89), Some(0xe0), // mov %rsp,%r8: &written, the fifth argument
    Some(0xe8), None, None, None, None, // call <internal>
    Some(0x85), Some(0xc0), // test %eax,%eax
    Some(0x7e), None, // jle
];

const TEMPLATES: [Template; 2] = [
    Template { bytes: &OPENSSL3_0, call_at: 30, jump_at: 37, count_arg: 3 },
    Template { bytes: &OPENSSL3_2_WRITE, call_at: 32, jump_at: 39, count_arg: 4 },
];
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];

/// Where the call-site probes of a function go, when its first bytes are a prologue the agent
/// recognises: offsets from its start of the call and of the jump, and the argument that points
/// at the byte count.
#[must_use]
pub fn call_site(code: &[u8]) -> Option<(u64, u64, u64)> {
    let (skip, code) = match code.strip_prefix(&ENDBR64) {
        Some(rest) => (ENDBR64.len() as u64, rest),
        None => (0, code),
    };
    TEMPLATES.iter().find_map(|t| {
        let matches =
            code.len() >= t.bytes.len() && t.bytes.iter().zip(code).all(|(want, got)| want.is_none_or(|w| w == *got));
        matches.then_some((skip + t.call_at, skip + t.jump_at, t.count_arg))
    })
}

/// One probe to attach: a program at a file offset of the object, with its attach cookie.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbePoint {
    pub program: &'static str,
    pub offset: u64,
    pub cookie: u64,
}

/// The probe points of an ELF object (`data`), or `None` when it does not define both `SSL_read`
/// and `SSL_write` (an import, a stripped library, not a TLS library). Call sites are used where
/// recognised, unless `call_sites` is false; the templates are `x86_64` code, so an object of any
/// other architecture gets entry and return probes. On `aarch64` call sites would save nothing:
/// in Debian 12's `SSL_read`/`SSL_write` a probe on the `bl` to the internal call costs one trap
/// (arm64's uprobes simulate a `bl`), but the instruction after the call is a `cmp` (then an `ldr`
/// and a branchless `csel`: no branch to put the second probe on), which is single-stepped, two
/// traps: three per call, as many as entry and return (the entry's `sub sp`, single-stepped, two;
/// the return, one). Each function's closing probe
/// comes before its opening one, so that attaching in this order never leaves a call noted that
/// nothing clears.
#[must_use]
pub fn attach_plan(data: &[u8], call_sites: bool) -> Option<Vec<ProbePoint>> {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    let file = object::File::parse(data).ok()?;
    let call_sites = call_sites && file.architecture() == object::Architecture::X86_64;
    let offset_of = |name: &str| -> Option<u64> {
        let symbol =
            file.dynamic_symbols().chain(file.symbols()).find(|s| s.is_definition() && s.name() == Ok(name))?;
        let section = file.section_by_index(symbol.section_index()?).ok()?;
        let (file_offset, _) = section.file_range()?;
        symbol.address().checked_sub(section.address())?.checked_add(file_offset)
    };
    let mut plan = Vec::with_capacity(6);
    for f in &FUNCTIONS {
        let Some(start) = offset_of(f.symbol) else {
            if f.call_site.is_some() {
                return None;
            }
            continue;
        };
        let code = usize::try_from(start).ok().and_then(|s| data.get(s..s.checked_add(48)?));
        if let (Some((call, done)), Some((call_at, jump_at, count_arg))) =
            (f.call_site.filter(|_| call_sites), code.and_then(call_site))
        {
            plan.push(ProbePoint { program: done, offset: start + jump_at, cookie: 0 });
            plan.push(ProbePoint { program: call, offset: start + call_at, cookie: count_arg });
        } else {
            plan.push(ProbePoint { program: f.ret, offset: start, cookie: 0 });
            plan.push(ProbePoint { program: f.entry, offset: start, cookie: 0 });
        }
    }
    Some(plan)
}

/// The largest object file read for a plan: a file a traced process maps is chosen by that
/// process, and a larger one is refused rather than read whole.
const MAX_OBJECT_BYTES: u64 = 256 << 20;

/// Files whose plans the cache keeps; past that it starts over (a node runs few TLS builds).
const MAX_CACHED_PLANS: usize = 64;

/// A plan, or why the file could not be read for one.
type Made = Result<Option<Arc<[ProbePoint]>>, String>;

/// [`attach_plan`] of each object file, by device, inode, size and change times: workers of one
/// `HAProxy` (every reload brings new ones) map the same library, which is read and parsed once,
/// and not on the capture thread: a file a traced process maps is of its choosing, and reading a
/// large one must not stall the drain of the ring. A file not planned yet is read by the planner
/// thread ([`PlanCache::plan`] says [`Planned::Pending`]), and the caller asks again once
/// [`PlanCache::take_made`] says a plan was made.
#[derive(Debug)]
pub struct PlanCache {
    made: Arc<Mutex<HashMap<PlanKey, Made>>>,
    /// To the planner thread, started at the first file not planned yet.
    requests: Option<SyncSender<(PlanKey, PathBuf)>>,
    /// One message per plan made.
    done: Option<Receiver<()>>,
    in_flight: HashSet<PlanKey>,
    call_sites: bool,
}

/// What [`PlanCache::plan`] has for a file.
#[derive(Debug)]
pub enum Planned {
    /// The plan; `None`: the file does not define the TLS functions.
    Ready(Option<Arc<[ProbePoint]>>),
    /// Being read off the capture thread.
    Pending,
}

/// A file as [`PlanCache`] knows it: its identity and what changes when it is rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: (i64, i64),
    ctime_ns: (i64, i64),
}

impl PlanKey {
    fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt as _;
        // An inode is reused once its file is gone (an image pulled again), and a file can be
        // rewritten in place: the size and both change times tell such files apart.
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: (meta.mtime(), meta.mtime_nsec()),
            ctime_ns: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

impl PlanCache {
    /// Plans with call sites where the code is recognised, unless `call_sites` is false.
    #[must_use]
    pub fn new(call_sites: bool) -> Self {
        Self { made: Arc::default(), requests: None, done: None, in_flight: HashSet::new(), call_sites }
    }

    /// The plan of `object`, if made; else it is asked of the planner thread.
    pub fn plan(&mut self, object: &Path) -> std::io::Result<Planned> {
        let key = PlanKey::of(&std::fs::metadata(object)?);
        if let Some(made) = self.made.lock().map_err(|_| std::io::Error::other("plan cache poisoned"))?.get(&key) {
            self.in_flight.remove(&key);
            return made.clone().map(Planned::Ready).map_err(std::io::Error::other);
        }
        if self.in_flight.insert(key) {
            self.request(key, object.to_owned())?;
        }
        Ok(Planned::Pending)
    }

    /// Whether a plan was made since the last call (the callers whose files were pending may ask
    /// again).
    pub fn take_made(&mut self) -> bool {
        self.done.as_ref().is_some_and(|done| done.try_iter().count() > 0)
    }

    fn request(&mut self, key: PlanKey, object: PathBuf) -> std::io::Result<()> {
        if self.requests.is_none() {
            let (requests, inbox) = sync_channel::<(PlanKey, PathBuf)>(MAX_CACHED_PLANS);
            let (tell, done) = sync_channel::<()>(MAX_CACHED_PLANS);
            let (made, call_sites) = (Arc::clone(&self.made), self.call_sites);
            std::thread::Builder::new().name("tls-planner".into()).spawn(move || {
                for (key, object) in inbox {
                    let plan = read_plan(&object, call_sites);
                    let Ok(mut made) = made.lock() else { return };
                    if made.len() >= MAX_CACHED_PLANS {
                        made.clear();
                    }
                    made.insert(key, plan);
                    drop(made);
                    let _ = tell.try_send(());
                }
            })?;
            self.requests = Some(requests);
            self.done = Some(done);
        }
        let sent = self.requests.as_ref().is_some_and(|r| r.try_send((key, object)).is_ok());
        if !sent {
            // The planner is behind (or gone): asked again at the next call.
            self.in_flight.remove(&key);
        }
        Ok(())
    }
}

/// Reads `object`, at most [`MAX_OBJECT_BYTES`] of it, for its plan.
fn read_plan(object: &Path, call_sites: bool) -> Made {
    use std::io::Read as _;
    let file = std::fs::File::open(object).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    if len > MAX_OBJECT_BYTES {
        return Err(format!("larger than {MAX_OBJECT_BYTES} bytes; not read"));
    }
    let mut data = Vec::with_capacity(len as usize);
    file.take(MAX_OBJECT_BYTES).read_to_end(&mut data).map_err(|e| e.to_string())?;
    Ok(attach_plan(&data, call_sites).map(Into::into))
}

/// Files mapped executable by the process that may hold the TLS functions: every `libssl*`, and
/// the program itself (a static build), each once with the inode the mapping names. Paths are as
/// `/proc/PID/maps` shows them to the agent.
#[must_use]
pub fn candidate_objects(maps: &MemoryMaps, exe: Option<&Path>) -> Vec<(PathBuf, u64)> {
    let mut out: BTreeSet<(PathBuf, u64)> = BTreeSet::new();
    for map in maps {
        let MMapPath::Path(path) = &map.pathname else { continue };
        if !map.perms.contains(MMPermissions::EXECUTE) {
            continue;
        }
        let is_libssl = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libssl"));
        if is_libssl || exe == Some(path.as_path()) {
            out.insert((path.clone(), map.inode));
        }
    }
    // The program first: a static build answers there and no library is needed.
    let (mut ordered, rest): (Vec<_>, Vec<_>) = out.into_iter().partition(|(p, _)| Some(p.as_path()) == exe);
    ordered.extend(rest);
    ordered
}

/// [`candidate_objects`] of process `pid`, as paths the agent can open. `/proc/PID/maps` shows a
/// path from the reader's root when it can (a chroot on the host's mounts: the host path), else
/// from the process's own mount namespace (a container: the path inside it). So the path is tried
/// under `/proc/PID/root` first, then as it is, then from the top of the process's mount namespace
/// (a process that `chroot`ed itself), and kept only where its inode is the mapping's.
///
/// Candidates that cannot be opened so (a library deleted or replaced on disk since the process
/// mapped it, a mount the agent does not see) come back apart, as paths as `maps` shows them, so
/// that the caller can say why a process that maps a TLS library is not probed.
pub fn objects_of(proc_root: &Path, pid: u32) -> std::io::Result<Objects> {
    use std::os::unix::fs::MetadataExt as _;
    let dir = proc_root.join(pid.to_string());
    let file = std::fs::File::open(dir.join("maps"))?;
    let maps = MemoryMaps::from_buf_read(BufReader::new(file)).map_err(std::io::Error::other)?;
    let exe = std::fs::read_link(dir.join("exe")).ok();
    let root = dir.join("root");
    let mut objects = Objects::default();
    for (path, inode) in candidate_objects(&maps, exe.as_deref()) {
        let inside = path.strip_prefix("/").unwrap_or(&path);
        // A process that `chroot`ed itself (HAProxy's `chroot` directive) mapped its libraries
        // before, and `maps` shows their paths from the top of its mount namespace: `..` of
        // `/proc/PID/root` until it goes no higher.
        let above_jail = crate::procfs::jail::above(&root).pop().map(|top| top.join(inside));
        let found = [root.join(inside), path.clone()]
            .into_iter()
            .chain(above_jail)
            .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == inode));
        match found {
            Some(usable) => objects.usable.push(usable),
            // The program itself is always a candidate; only a library missing says something.
            None if Some(path.as_path()) != exe.as_deref() => objects.unreachable.push(path),
            None => {}
        }
    }
    Ok(objects)
}

/// What [`objects_of`] found.
#[derive(Debug, Default)]
pub struct Objects {
    /// Paths the agent can open, in the order to try them.
    pub usable: Vec<PathBuf>,
    /// TLS libraries the process maps that the agent cannot open with the mapped inode.
    pub unreachable: Vec<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_puts_a_return_program_where_a_return_probe_was_and_an_entry_one_elsewhere() {
        for f in &FUNCTIONS {
            assert_eq!(floor_twin(f.ret), FLOOR_RETURN_PROGRAM, "{}", f.ret);
            assert_eq!(floor_twin(f.entry), FLOOR_PROGRAM, "{}", f.entry);
            for program in f.call_site.iter().flat_map(|(call, done)| [*call, *done]) {
                assert_eq!(floor_twin(program), FLOOR_PROGRAM, "{program}");
            }
        }
        assert!(PROGRAMS.contains(&FLOOR_PROGRAM) && PROGRAMS.contains(&FLOOR_RETURN_PROGRAM), "loaded at start");
    }

    const MAPS: &str = "\
55d0c0000000-55d0c0050000 r--p 00000000 fe:01 1311 /usr/sbin/haproxy
55d0c0050000-55d0c0250000 r-xp 00050000 fe:01 1311 /usr/sbin/haproxy
7f0000000000-7f0000020000 r--p 00000000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000020000-7f0000080000 r-xp 00020000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000100000-7f0000300000 r-xp 00020000 fe:01 2002 /usr/lib/x86_64-linux-gnu/libcrypto.so.3
7f0000400000-7f0000401000 rw-p 00000000 00:00 0 [heap]
7f0000500000-7f0000501000 r--p 00000000 fe:01 2003 /opt/libssl-notes.txt
";

    fn maps(text: &str) -> MemoryMaps {
        MemoryMaps::from_buf_read(text.as_bytes()).unwrap()
    }

    #[test]
    fn the_program_then_each_executable_libssl_once() {
        let found = candidate_objects(&maps(MAPS), Some(Path::new("/usr/sbin/haproxy")));
        assert_eq!(
            found,
            [
                (PathBuf::from("/usr/sbin/haproxy"), 1311),
                (PathBuf::from("/usr/lib/x86_64-linux-gnu/libssl.so.3"), 2001)
            ]
        );
    }

    #[test]
    fn without_a_readable_program_only_libraries() {
        let found = candidate_objects(&maps(MAPS), None);
        assert_eq!(found, [(PathBuf::from("/usr/lib/x86_64-linux-gnu/libssl.so.3"), 2001)]);
    }

    /// Debian 12's `SSL_read` (libssl3 3.0), first 48 bytes.
    const DEBIAN12_SSL_READ: &str =
        "4883ec18 64488b042528000000 4889442408 31c0 85d2 782f 4889e1 4863d2 e83dfeffff 85c0 7e03 8b0424 488b542408";

    fn hex(text: &str) -> Vec<u8> {
        let digits: String = text.split_whitespace().collect();
        (0..digits.len()).step_by(2).map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn openssl3_call_sites_with_and_without_endbr64() {
        let plain = hex(DEBIAN12_SSL_READ);
        assert_eq!(call_site(&plain), Some((30, 37, 3)));
        assert_eq!(plain[30], 0xe8, "a call");
        assert_eq!(plain[37], 0x7e, "a jle");
        let mut cet = ENDBR64.to_vec();
        cet.extend_from_slice(&plain);
        assert_eq!(call_site(&cet), Some((34, 41, 3)));
    }

    /// Debian 13's `SSL_write` (libssl3t64 3.5), first 48 bytes after `endbr64`.
    const DEBIAN13_SSL_WRITE: &str =
        "4883ec18 64488b042528000000 4889442408 31c0 85d2 7834 31c9 4863d2 4989e0 e8f7faffff 85c0 7e03 8b0424 488b5424";

    #[test]
    fn openssl32_ssl_write_passes_the_count_in_the_fifth_argument() {
        let mut code = ENDBR64.to_vec();
        code.extend_from_slice(&hex(DEBIAN13_SSL_WRITE));
        assert_eq!(call_site(&code), Some((36, 43, 4)));
        assert_eq!(code[36], 0xe8, "a call");
        assert_eq!(code[43], 0x7e, "a jle");
    }

    #[test]
    fn debian13s_libssl_gets_call_sites_for_both_functions() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/trixie");
        let data =
            std::fs::read(root.join("usr/lib/x86_64-linux-gnu/libssl.so.3")).expect("the trixie tree (make setup)");
        let plan = attach_plan(&data, true).expect("libssl defines SSL_read and SSL_write");
        let cookies: Vec<_> =
            plan.iter().filter(|p| p.program.ends_with("_call")).map(|p| (p.program, p.cookie)).collect();
        assert_eq!(cookies, [("ssl_read_call", 3), ("ssl_write_call", 4)]);
    }

    #[test]
    fn any_other_code_gets_entry_probes() {
        let mut other = hex(DEBIAN12_SSL_READ);
        other[28] = 0x90; // one byte differs
        assert_eq!(call_site(&other), None);
        assert_eq!(call_site(&hex(DEBIAN12_SSL_READ)[..20]), None, "too short");
        assert_eq!(call_site(&[]), None);
    }

    #[test]
    fn this_machines_libssl_gets_call_site_probes() {
        let data = std::fs::read("/usr/lib/x86_64-linux-gnu/libssl.so.3").expect("libssl3 (Debian 12)");
        let plan = attach_plan(&data, true).expect("libssl defines SSL_read and SSL_write");
        let programs: Vec<_> = plan.iter().map(|p| p.program).collect();
        assert_eq!(
            programs,
            [
                "ssl_read_done",
                "ssl_read_call",
                "ssl_write_done",
                "ssl_write_call",
                "ssl_handshake_return",
                "ssl_handshake_entry"
            ],
            "closing probes first"
        );
        assert!(plan.iter().filter(|p| p.program.ends_with("_call")).all(|p| p.cookie == 3), "{plan:?}");
        for p in &plan {
            let at = usize::try_from(p.offset).unwrap();
            let expected = match p.program {
                "ssl_read_call" | "ssl_write_call" => 0xe8,
                "ssl_read_done" | "ssl_write_done" => 0x7e,
                _ => data[at],
            };
            assert_eq!(data[at], expected, "{p:?}");
        }
    }

    #[test]
    fn an_arm64_libssl_gets_entry_and_return_probes() {
        use object::{Object as _, ObjectSegment as _, ObjectSymbol as _};
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/vm-bookworm-arm64");
        let data = std::fs::read(root.join("usr/lib/aarch64-linux-gnu/libssl.so.3"))
            .expect("Debian 12's arm64 tree (make setup)");
        let plan = attach_plan(&data, true).expect("libssl defines SSL_read and SSL_write");
        let programs: Vec<_> = plan.iter().map(|p| p.program).collect();
        assert_eq!(
            programs,
            [
                "ssl_read_return",
                "ssl_read_entry",
                "ssl_write_return",
                "ssl_write_entry",
                "ssl_handshake_return",
                "ssl_handshake_entry"
            ],
            "the call-site templates are x86_64 code; closing probes first"
        );
        // Each function's start, found another way: its address through the loadable segment
        // that holds it (the plan goes through the symbol's section).
        let file = object::File::parse(&*data).unwrap();
        let file_offset = |name: &str| {
            let address = file.dynamic_symbols().find(|s| s.name() == Ok(name)).unwrap().address();
            let segment =
                file.segments().find(|seg| (seg.address()..seg.address() + seg.size()).contains(&address)).unwrap();
            address - segment.address() + segment.file_range().0
        };
        for (pair, name) in plan.chunks(2).zip(["SSL_read", "SSL_write", "SSL_do_handshake"]) {
            assert_eq!(pair[0].offset, file_offset(name), "{name}: {pair:?}");
            assert_eq!(pair[1].offset, file_offset(name), "{name}: {pair:?}");
        }
    }

    #[test]
    fn a_program_that_only_imports_the_functions_has_no_plan() {
        let data = std::fs::read("/usr/sbin/haproxy").expect("haproxy (make setup)");
        assert_eq!(attach_plan(&data, true), None);
    }

    #[test]
    fn entry_probes_when_call_sites_are_not_wanted() {
        let data = std::fs::read("/usr/lib/x86_64-linux-gnu/libssl.so.3").expect("libssl3 (Debian 12)");
        let plan = attach_plan(&data, false).expect("libssl defines SSL_read and SSL_write");
        assert!(plan.iter().all(|p| p.program.ends_with("_entry") || p.program.ends_with("_return")), "{plan:?}");
        assert_eq!(plan.len(), 6);
    }

    /// Waits (10 s at most, for liveness) until `object`'s plan is made off this thread.
    fn planned(cache: &mut PlanCache, object: &Path) -> Option<Arc<[ProbePoint]>> {
        for _ in 0..1000 {
            match cache.plan(object).expect("a readable file") {
                Planned::Ready(plan) => return plan,
                Planned::Pending => {
                    let _ = cache.take_made();
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        }
        panic!("no plan made for {}", object.display());
    }

    #[test]
    fn plans_are_made_off_the_callers_thread_and_follow_a_file_rewritten_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let object = dir.path().join("libssl.so.3");
        std::fs::copy("/usr/lib/x86_64-linux-gnu/libssl.so.3", &object).expect("libssl3 (Debian 12)");
        let mut cache = PlanCache::new(true);
        assert!(matches!(cache.plan(&object).unwrap(), Planned::Pending), "not read on the caller's thread");
        assert!(planned(&mut cache, &object).is_some(), "libssl defines the TLS functions");
        // Rewritten in place (same inode): another file, planned afresh.
        std::fs::write(&object, std::fs::read("/usr/sbin/haproxy").expect("haproxy (make setup)")).unwrap();
        assert!(planned(&mut cache, &object).is_none(), "HAProxy only imports them");
    }

    #[test]
    fn objects_are_reached_through_the_process_root() {
        let pid = std::process::id();
        let found = objects_of(Path::new("/proc"), pid).unwrap().usable;
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let expected = Path::new("/proc").join(pid.to_string()).join("root").join(exe.strip_prefix("/").unwrap());
        assert_eq!(found.first(), Some(&expected), "the test binary maps itself executable");
    }
}
