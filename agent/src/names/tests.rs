//! Tests of the names loads and of the runtime API reads: fake process trees under a temporary
//! `/proc`, hostile files, scripted runtime answers.

use std::fs::File;
use std::io;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use super::*;

#[test]
fn command_line_config_paths() {
    assert_eq!(
        config_paths(b"haproxy\0-f\0/etc/haproxy/haproxy.cfg\0-f\0conf.d\0-p\0/run/h.pid\0"),
        vec!["/etc/haproxy/haproxy.cfg", "conf.d"]
    );
    assert_eq!(config_paths(b"haproxy\0-f/etc/a.cfg\0-Ws\0"), vec!["/etc/a.cfg"]);
    assert!(config_paths(b"haproxy\0-f").is_empty());
    assert_eq!(
        config_paths(b"haproxy\0-W\0-f\0/etc/a.cfg\0--\0/etc/b.cfg\0-f\0"),
        vec!["/etc/a.cfg", "/etc/b.cfg", "-f"],
        "after `--` every argument is a file, in order"
    );
}

/// A fake `/proc` with process 7 whose root is `root` (a directory of the test, or `/`) and
/// whose command line gives `args` after `-f`.
struct FakeProc {
    dir: tempfile::TempDir,
}

const PID: u32 = 7;

impl FakeProc {
    fn new(root: Option<&Path>, cwd: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pid_dir = dir.path().join("proc").join(PID.to_string());
        std::fs::create_dir_all(&pid_dir).unwrap();
        std::fs::create_dir(dir.path().join("rootfs")).unwrap();
        let root = root.map_or_else(|| dir.path().join("rootfs"), Path::to_owned);
        std::os::unix::fs::symlink(root, pid_dir.join("root")).unwrap();
        std::os::unix::fs::symlink(cwd, pid_dir.join("cwd")).unwrap();
        let mut cmdline = b"haproxy\0-W\0".to_vec();
        for a in args {
            cmdline.extend_from_slice(b"-f\0");
            cmdline.extend_from_slice(a.as_bytes());
            cmdline.push(0);
        }
        std::fs::write(pid_dir.join("cmdline"), cmdline).unwrap();
        Self { dir }
    }

    fn proc_root(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    fn rootfs(&self, name: &str) -> PathBuf {
        self.dir.path().join("rootfs").join(name)
    }

    fn load(&self) -> Outcome {
        load_within_10s(self.proc_root(), PID)
    }
}

/// Loads in a thread; fails the test if the load has not returned within 10 s (a liveness
/// check: every case here returns in milliseconds, a hang never does).
fn load_within_10s(proc_root: PathBuf, pid: u32) -> Outcome {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(load(&proc_root, pid));
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("the load hung")
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

const FE: &str = "frontend fe_good\n bind 127.0.0.1:7001\n";

fn loaded_good(outcome: &Outcome) -> bool {
    outcome.names.as_ref().is_some_and(|n| n.frontend("127.0.0.1:7001".parse().unwrap()) == Some("fe_good"))
}

fn problem_about(outcome: &Outcome, what: &str, why: &str) -> bool {
    outcome.problems.iter().any(|p| p.contains(what) && p.contains(why))
}

/// HAProxy's `chroot`: `/proc/PID/root` is the jail, the configuration is where the process
/// started, above it, and used only when its `chroot` is that jail; a configuration in the
/// jail itself wins.
#[test]
fn a_process_in_its_chroot_jail_is_read_from_the_root_it_started_in() {
    let tree = tempfile::tempdir().unwrap();
    let jail = tree.path().join("var/lib/haproxy");
    std::fs::create_dir_all(&jail).unwrap();
    std::fs::create_dir_all(tree.path().join("etc/haproxy")).unwrap();
    let cfg = tree.path().join("etc/haproxy/haproxy.cfg");
    std::fs::write(&cfg, format!("global\n chroot /var/lib/haproxy\n{FE}")).unwrap();
    let proc = FakeProc::new(Some(&jail), "/", &["/etc/haproxy/haproxy.cfg"]);
    assert!(loaded_good(&proc.load()), "read from three directories above the jail");

    // Confined by someone else: the file above is not the process's, whatever it says.
    std::fs::write(&cfg, format!("global\n chroot /somewhere/else\n{FE}")).unwrap();
    let outcome = proc.load();
    assert!(outcome.names.is_none(), "a chroot that is not the process's root: not used");
    assert!(problem_about(&outcome, "haproxy.cfg", "names no `chroot`"), "{:?}", outcome.problems);
    std::fs::write(&cfg, FE).unwrap();
    assert!(proc.load().names.is_none(), "no chroot at all: not used");

    std::fs::create_dir_all(jail.join("etc/haproxy")).unwrap();
    std::fs::write(jail.join("etc/haproxy/haproxy.cfg"), "frontend fe_jail\n bind 127.0.0.1:7001\n").unwrap();
    let names = proc.load().names.expect("names");
    assert_eq!(names.frontend("127.0.0.1:7001".parse().unwrap()), Some("fe_jail"), "the process's own root first");
}

#[test]
fn hostile_files_fail_promptly_and_regular_files_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.cfg");
    std::fs::write(&good, FE).unwrap();
    let fifo = dir.path().join("fifo.cfg");
    mkfifo(&fifo);
    let big = dir.path().join("big.cfg");
    File::create(&big).unwrap().set_len(MAX_CONFIG_BYTES + 1).unwrap();
    let zero_link = dir.path().join("zero.cfg");
    std::os::unix::fs::symlink("/dev/zero", &zero_link).unwrap();
    let (loop_a, loop_b) = (dir.path().join("a.cfg"), dir.path().join("b.cfg"));
    std::os::unix::fs::symlink(&loop_b, &loop_a).unwrap();
    std::os::unix::fs::symlink(&loop_a, &loop_b).unwrap();
    let cases: [(&Path, &str); 5] = [
        (&fifo, "a FIFO"),
        (&big, "cap"),
        (Path::new("/dev/zero"), "a character device"),
        (&zero_link, "a character device"),
        (&loop_a, "symbolic links"),
    ];
    for (bad, why) in cases {
        let bad_arg = bad.to_str().unwrap();
        let proc = FakeProc::new(Some(Path::new("/")), "/", &[bad_arg, good.to_str().unwrap()]);
        let outcome = proc.load();
        assert!(problem_about(&outcome, bad_arg, why), "{bad_arg}: {:?}", outcome.problems);
        assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
        assert!(loaded_good(&outcome), "{bad_arg}: the regular file still loads");
        let alone = FakeProc::new(Some(Path::new("/")), "/", &[bad_arg]).load();
        assert!(alone.names.is_none() && problem_about(&alone, bad_arg, why), "{bad_arg}: {:?}", alone.problems);
    }
}

#[test]
fn a_directory_with_a_fifo_loads_its_regular_files() {
    let proc = FakeProc::new(None, "/etc/haproxy", &["conf.d"]);
    let conf = proc.rootfs("etc/haproxy/conf.d");
    std::fs::create_dir_all(&conf).unwrap();
    std::fs::write(conf.join("00-defaults.cfg"), "defaults\n mode http\n").unwrap();
    std::fs::write(conf.join("10-fe.cfg"), FE).unwrap();
    mkfifo(&conf.join("20-fifo.cfg"));
    std::fs::write(conf.join("30-be.cfg"), "backend be_x\n server s1 127.0.0.1:7002\n").unwrap();
    std::fs::write(conf.join("ignored.txt"), "frontend nope\n bind :1\n").unwrap();
    std::os::unix::fs::symlink("/dev/zero", conf.join("40-zero.cfg")).unwrap();
    let outcome = proc.load();
    assert!(loaded_good(&outcome));
    let names = outcome.names.unwrap();
    assert!(!names.bind("127.0.0.1:7001".parse().unwrap()).unwrap().tcp, "defaults from an earlier file");
    assert_eq!(names.server("127.0.0.1:7002".parse().unwrap()), Some(("be_x", "s1")));
    assert_eq!(names.frontend("127.0.0.1:1".parse().unwrap()), None);
    assert_eq!(outcome.problems.len(), 2, "{:?}", outcome.problems);
    assert!(outcome.problems.iter().any(|p| p.contains("20-fifo.cfg") && p.contains("a FIFO")));
    // Inside this root there is no /dev/zero: the absolute link resolves in the root.
    assert!(outcome.problems.iter().any(|p| p.contains("40-zero.cfg") && p.contains("No such file")));
}

#[test]
fn paths_and_links_stay_inside_the_process_root() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret.cfg"), "frontend secret\n bind :9\n").unwrap();
    let escape = format!("../../../../../../../../..{}/secret.cfg", outside.path().display());
    let proc = FakeProc::new(None, "/etc", &[&escape, "/etc/link.cfg", "/etc/rel.cfg"]);
    std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
    std::fs::create_dir_all(proc.rootfs(outside.path().strip_prefix("/").unwrap().to_str().unwrap())).unwrap();
    std::fs::write(
        proc.rootfs(&format!("{}/secret.cfg", outside.path().strip_prefix("/").unwrap().display())),
        "frontend inside\n bind :9\n",
    )
    .unwrap();
    std::fs::write(proc.rootfs("etc/real.cfg"), FE).unwrap();
    std::os::unix::fs::symlink("/etc/real.cfg", proc.rootfs("etc/link.cfg")).unwrap();
    std::os::unix::fs::symlink("../../../etc/./real.cfg", proc.rootfs("etc/rel.cfg")).unwrap();
    let outcome = proc.load();
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    let names = outcome.names.unwrap();
    assert_eq!(names.frontend("127.0.0.1:9".parse().unwrap()), Some("inside"), "`..` stops at the root");
    assert_eq!(names.frontends.len(), 3, "both links lead to the file inside the root");
}

#[test]
fn directories_files_and_bytes_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let crowded = dir.path().join("crowded");
    std::fs::create_dir(&crowded).unwrap();
    for i in 0..=MAX_DIR_ENTRIES {
        std::fs::write(crowded.join(format!("{i}.junk")), "").unwrap();
    }
    let outcome = FakeProc::new(Some(Path::new("/")), "/", &[crowded.to_str().unwrap()]).load();
    assert!(problem_about(&outcome, "crowded", "entries") && outcome.problems.len() == 1, "{:?}", outcome.problems);

    // The directory is one of the paths opened: it leaves room for MAX_CONFIG_FILES - 1 files.
    let many = dir.path().join("many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..MAX_CONFIG_FILES {
        std::fs::write(many.join(format!("{i:04}.cfg")), if i == 0 { FE } else { "" }).unwrap();
    }
    let outcome = FakeProc::new(Some(Path::new("/")), "/", &[many.to_str().unwrap()]).load();
    let last = format!("{:04}.cfg", MAX_CONFIG_FILES - 1);
    assert!(problem_about(&outcome, &last, "files"), "{:?}", outcome.problems);
    assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
    assert!(loaded_good(&outcome));
    let zeros = vec!["/dev/zero"; 10 * MAX_CONFIG_FILES];
    let outcome = FakeProc::new(Some(Path::new("/")), "/", &zeros).load();
    assert_eq!(outcome.problem_count, zeros.len(), "every argument is a problem");
    assert_eq!(outcome.problems.len(), MAX_PROBLEMS_KEPT, "a few are kept for the warning");
    assert!(outcome.problems.iter().all(|p| p.contains("character device")), "the first ones");

    let half = dir.path().join("half.cfg");
    File::create(&half).unwrap().set_len(MAX_CONFIG_BYTES / 2 + 1).unwrap();
    let good = dir.path().join("good.cfg");
    std::fs::write(&good, FE).unwrap();
    let (half, good) = (half.to_str().unwrap(), good.to_str().unwrap());
    let outcome = FakeProc::new(Some(Path::new("/")), "/", &[half, half, good]).load();
    assert!(problem_about(&outcome, "half.cfg", "cap"), "the total is capped: {:?}", outcome.problems);
    assert_eq!(outcome.problems.len(), 1, "{:?}", outcome.problems);
    assert!(loaded_good(&outcome));
}

#[test]
fn unreadable_process_and_missing_arguments() {
    let none = FakeProc::new(None, "/", &[]).load();
    assert!(none.names.is_none() && none.problems[0].contains("no -f"));
    let gone = FakeProc::new(None, "/", &["/x.cfg"]);
    let outcome = load_within_10s(gone.proc_root(), PID + 1);
    assert!(outcome.names.is_none() && outcome.problems[0].contains("cmdline"));
}

#[test]
fn reads_a_real_process_through_proc() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("h.cfg"), FE).unwrap();
    // `sh -c SCRIPT -f FILE`: the command line has `-f FILE`, and the `:` keeps sh from
    // replacing itself with sleep.
    let mut child =
        Command::new("sh").args(["-c", "sleep 30; :", "-f", "h.cfg"]).current_dir(dir.path()).spawn().unwrap();
    // Until the child has exec'd, /proc/PID/cmdline is still the test binary's.
    let cmdline = PathBuf::from(format!("/proc/{}/cmdline", child.id()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read(&cmdline).is_ok_and(|c| c.windows(4).any(|w| w == b"\0-f\0")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let outcome = load_within_10s(PathBuf::from("/proc"), child.id());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(outcome.problems.is_empty(), "{:?}", outcome.problems);
    assert!(loaded_good(&outcome), "relative to the process's cwd, through /proc/PID/root");
}

fn wait_for(names: &mut Names, pid: u32) -> Option<Arc<ProxyNames>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(n) = names.of(pid) {
            return Some(n);
        }
        if matches!(names.by_pid.get(&pid), Some(State::Done { .. })) || Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn names_arrive_in_the_background() {
    let proc = FakeProc::new(None, "/", &["/etc/h.cfg", "/missing.cfg"]);
    std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
    std::fs::write(proc.rootfs("etc/h.cfg"), FE).unwrap();
    let mut names = Names::new(&proc.proc_root(), false);
    let metrics = Metrics::default();
    names.refresh(&BTreeSet::from([PID]), &metrics, 0);
    assert!(!names.any_settled(&BTreeSet::from([PID])));
    let got = wait_for(&mut names, PID).expect("names arrive");
    assert!(names.any_settled(&BTreeSet::from([PID])));
    assert_eq!(got.frontend("127.0.0.1:7001".parse().unwrap()), Some("fe_good"));
    names.refresh(&BTreeSet::from([PID]), &metrics, 0);
    assert_eq!(metrics.config_read_errors.load(std::sync::atomic::Ordering::Relaxed), 1, "the missing file");
    names.forget_process(PID);
    assert!(names.of(PID).is_some(), "kept a while for the spans of its last requests");
    names.refresh(&BTreeSet::new(), &metrics, 0);
    assert!(names.by_pid.contains_key(&PID), "not a target any more, forgotten only after FORGET_AFTER");
}

static TABLES_READ: AtomicUsize = AtomicUsize::new(0);

/// A runtime API that answers two tables, then refuses: first `SRV_1` at :9001; then `SRV_1`
/// emptied and `SRV_2` at :9001 (a slot moved, as on a pod restart); then permission denied.
fn scripted_runtime(
    _: &Path,
    _: u32,
    path: &str,
    _: Option<&str>,
    _: Duration,
) -> Result<ServersState, RuntimeApiError> {
    assert_eq!(path, "/run/admin.sock");
    let header = "1\n# be_name srv_name srv_addr srv_port srv_admin_state\n";
    match TABLES_READ.fetch_add(1, SeqCst) {
        0 => Ok(tracetap_proxy::haproxy_runtime::parse_servers_state(&format!(
            "{header}be SRV_1 127.0.0.1 9001 0\nbe SRV_2 127.0.0.1 1 4\n"
        ))
        .unwrap()),
        1 => Ok(tracetap_proxy::haproxy_runtime::parse_servers_state(&format!(
            "{header}be SRV_1 127.0.0.1 1 4\nbe SRV_2 127.0.0.1 9001 0\n"
        ))
        .unwrap()),
        _ => Err(RuntimeApiError::Denied {
            path: path.to_owned(),
            source: io::Error::from(io::ErrorKind::PermissionDenied),
        }),
    }
}

#[test]
fn runtime_tables_name_servers_as_they_were_when_sent_and_failures_fall_back() {
    use tracetap_proxy::haproxy_config::ServerMatch;
    let proc = FakeProc::new(None, "/", &["/etc/h.cfg"]);
    std::fs::create_dir_all(proc.rootfs("etc")).unwrap();
    std::fs::write(
        proc.rootfs("etc/h.cfg"),
        "global\n    stats socket /run/admin.sock mode 600 level admin\n\
         frontend f\n    bind 127.0.0.1:7001\n    default_backend be\n\
         backend be\n    server-template SRV_ 2 127.0.0.1:1 disabled\n",
    )
    .unwrap();
    let mut names = {
        let mut names = Names::new(&proc.proc_root(), true);
        names.runtime.reader = scripted_runtime;
        names
    };
    let metrics = Metrics::default();
    let pids = BTreeSet::from([PID]);
    let app: std::net::SocketAddr = "127.0.0.1:9001".parse().unwrap();
    let server =
        |n: &Option<Arc<ProxyNames>>, sent: u64| match n.as_ref().unwrap().server_for_sent(app, Some("f"), sent) {
            ServerMatch::Named { server, .. } => Some(server.to_owned()),
            ServerMatch::Ambiguous => Some("ambiguous".to_owned()),
            ServerMatch::Unknown => None,
        };
    // Waits (ticking at `now_ns`) until the names for a request sent at `sent` are settled.
    let settled = |names: &mut Names, sent: u64, now_ns: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            names.tick(now_ns);
            if let NamesAt::Ready(n) = names.settled_at(PID, sent) {
                return server(&n, sent);
            }
            assert!(Instant::now() < deadline, "settled in time");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    names.refresh(&pids, &metrics, 1_000);
    assert!(wait_for(&mut names, PID).is_some());
    assert!(matches!(names.settled_at(PID, 1_500), NamesAt::Wait), "the first table is not read yet");
    assert_eq!(server(&names.of(PID), 1_500), None, "the configuration alone does not know :9001");
    assert_eq!(
        settled(&mut names, 1_500, 2_000),
        Some("SRV_1".into()),
        "the read started after the request; the address is new, so the request went there under this name"
    );
    assert_eq!(names.runtime.reads, 1);
    // A request sent after that read waits for the next one, which sees the slot moved.
    assert!(matches!(names.settled_at(PID, 2_500), NamesAt::Wait));
    assert_eq!(
        settled(&mut names, 2_500, 3_000),
        Some("ambiguous".into()),
        "moved between the reads: either, so neither"
    );
    assert_eq!(names.runtime.reads, 2, "read again after {RUNTIME_MIN_GAP:?}, not {RUNTIME_REFRESH:?}");
    assert_eq!(server(&names.of(PID), 3_000), Some("SRV_2".into()), "after the move");
    assert_eq!(server(&names.of(PID), 1_500), Some("ambiguous".into()), "a slow request sent before it");
    // A refused read after tables were read: no server names (what changed since cannot be
    // known), at once, counted.
    assert_eq!(settled(&mut names, 3_500, 4_000), None);
    assert_eq!(names.runtime.errors, 1);
    assert!(matches!(names.settled_at(PID, 5_000), NamesAt::Ready(_)), "no waiting for a refusing socket");
    names.refresh(&pids, &metrics, 4_000);
    assert_eq!(metrics.runtime_api_errors.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(metrics.runtime_api_reads.load(std::sync::atomic::Ordering::Relaxed), 2);
}

static RELEASE: AtomicUsize = AtomicUsize::new(0);
static STARTED: AtomicUsize = AtomicUsize::new(0);

/// A load that hangs until the test lets it go (a FUSE file that never answers).
fn hanging(_: &Path, _: u32) -> Outcome {
    STARTED.fetch_add(1, SeqCst);
    while RELEASE.load(SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    Outcome { names: Some(ProxyNames::default()), ..Outcome::default() }
}

#[test]
fn hung_loads_never_block_and_hold_at_most_the_loader_slots() {
    let mut names = Names::with_loader(Path::new("/nonexistent"), hanging, Duration::from_millis(200));
    let metrics = Metrics::default();
    let pids: BTreeSet<u32> = (1..=5).collect();
    let started = Instant::now();
    for pid in &pids {
        assert!(names.of(*pid).is_none());
    }
    names.refresh(&pids, &metrics, 0);
    assert!(started.elapsed() < Duration::from_secs(5), "asking never waits for a load");
    while STARTED.load(SeqCst) < MAX_LOADERS {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(250));
    names.refresh(&pids, &metrics, 0);
    assert_eq!(STARTED.load(SeqCst), MAX_LOADERS, "no more threads than loader slots");
    assert_eq!(names.running, MAX_LOADERS);
    for pid in &pids {
        assert!(names.of(*pid).is_none());
        assert!(matches!(names.by_pid[pid], State::Done { names: None, .. }), "given up after the timeout");
    }
    assert_eq!(metrics.config_read_errors.load(std::sync::atomic::Ordering::Relaxed), 5);
    // A late answer frees its slot and is not taken for a process it no longer belongs to.
    RELEASE.store(1, SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    while names.running > 0 && Instant::now() < deadline {
        names.poll();
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(names.running, 0);
    assert!(names.of(1).is_none(), "a given-up process stays without names");
}
