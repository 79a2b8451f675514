//! Finds the processes to trace by walking `/proc`: every process with the target command name
//! (one small file per process), or the configured pids and their descendants (`HAProxy`'s master
//! forks its workers), followed down their `children` files. Kernels without those files
//! (`CONFIG_PROC_CHILDREN` off) get the full walk of every `stat`. The kernel documents the
//! `children` files as unreliable while children exit (a reload), so a process selected before
//! that is missing from them stays selected while it lives under the tree: one incomplete read
//! must not untrace a live worker and end its open exchanges.
//!
//! A walk can read one file per process on the host, so it runs on a thread of its own
//! ([`Discovery`]), never on the capture thread: a slow `/proc` (thousands of processes, a loaded
//! host) must not delay draining the ring. The capture thread takes the latest result without
//! waiting, and keeps the previous one until a new one is there.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::time::Duration;

use crate::config::Targets;

/// One `/proc` entry, as discovery needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    pub comm: String,
}

/// Reads every process under `proc_root` (normally `/proc`). Processes that vanish while we read
/// are skipped.
#[must_use]
pub fn read_processes(proc_root: &Path) -> Vec<ProcInfo> {
    pids(proc_root)
        .filter_map(|pid| parse_stat(pid, &fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?))
        .collect()
}

/// Reads the command name of every process under `proc_root`, with `ppid` 0: what a command
/// filter needs. `/proc/PID/comm` costs the kernel far less to produce than `stat`, and this walk
/// runs several times a second.
#[must_use]
pub fn read_command_names(proc_root: &Path) -> Vec<ProcInfo> {
    pids(proc_root)
        .filter_map(|pid| {
            let comm = fs::read_to_string(proc_root.join(pid.to_string()).join("comm")).ok()?;
            Some(ProcInfo { pid, ppid: 0, comm: comm.strip_suffix('\n').unwrap_or(&comm).to_owned() })
        })
        .collect()
}

/// The living processes among `roots` and all their descendants, found through
/// `/proc/PID/task/TID/children` of the processes found so far: it reads a few files per traced
/// process, not one per process on the host. `None` when this kernel has no `children` files.
#[must_use]
pub fn read_descendants(proc_root: &Path, roots: &[u32]) -> Option<BTreeSet<u32>> {
    let mut out = BTreeSet::new();
    let mut stack: Vec<u32> = roots.to_vec();
    while let Some(pid) = stack.pop() {
        let pid_dir = proc_root.join(pid.to_string());
        let Ok(tasks) = fs::read_dir(pid_dir.join("task")) else { continue };
        if !out.insert(pid) {
            continue;
        }
        let main_task = pid_dir.join("task").join(pid.to_string()).join("children");
        if matches!(fs::metadata(&main_task), Err(e) if e.kind() == std::io::ErrorKind::NotFound) && pid_dir.exists() {
            return None;
        }
        for task in tasks.filter_map(Result::ok) {
            if let Ok(children) = fs::read_to_string(task.path().join("children")) {
                stack.extend(children.split_ascii_whitespace().filter_map(|c| c.parse::<u32>().ok()));
            }
        }
    }
    Some(out)
}

/// The pid-mode selection: [`read_descendants`] (or, without `children` files, the full walk),
/// plus the processes of `previous` that the read missed but that still live with their parent
/// in the selection (see the module notes).
#[must_use]
pub fn select_pids(proc_root: &Path, roots: &[u32], previous: &BTreeSet<u32>) -> BTreeSet<u32> {
    let Some(mut found) = read_descendants(proc_root, roots) else {
        return select(&Targets::Pids(roots.to_vec()), &read_processes(proc_root));
    };
    // Parents first (lower pids, usually), and again until nothing changes: a missed worker's own
    // missed child is kept too.
    let mut missed: Vec<ProcInfo> = previous
        .difference(&found)
        .filter_map(|pid| parse_stat(*pid, &fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?))
        .collect();
    while let Some(at) = missed.iter().position(|p| found.contains(&p.ppid)) {
        found.insert(missed.swap_remove(at).pid);
    }
    found
}

fn pids(proc_root: &Path) -> impl Iterator<Item = u32> {
    fs::read_dir(proc_root)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
}

/// Parses `/proc/PID/stat`: `pid (comm) state ppid ...`, where comm may itself hold `)` or spaces.
#[must_use]
// Hand-written on purpose: procfs-core 0.18's `Stat` parser slices without checks and panics on
// a malformed line ("1 (a)"), and a panic here would stop discovery.
pub fn parse_stat(pid: u32, stat: &str) -> Option<ProcInfo> {
    let comm_start = stat.find('(')? + 1;
    let comm_end = stat.rfind(')')?;
    let comm = stat.get(comm_start..comm_end)?.to_owned();
    let mut rest = stat.get(comm_end + 1..)?.split_whitespace();
    let _state = rest.next()?;
    let parent = rest.next()?.parse().ok()?;
    Some(ProcInfo { pid, ppid: parent, comm })
}

/// The processes to trace among `procs`.
#[must_use]
pub fn select(targets: &Targets, procs: &[ProcInfo]) -> BTreeSet<u32> {
    match targets {
        Targets::Comm(comm) => procs.iter().filter(|p| &p.comm == comm).map(|p| p.pid).collect(),
        Targets::Pids(roots) => {
            let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
            for p in procs {
                children.entry(p.ppid).or_default().push(p.pid);
            }
            let alive: BTreeSet<u32> = procs.iter().map(|p| p.pid).collect();
            let mut out = BTreeSet::new();
            let mut stack: Vec<u32> = roots.iter().copied().filter(|p| alive.contains(p)).collect();
            while let Some(pid) = stack.pop() {
                if out.insert(pid) {
                    stack.extend(children.get(&pid).into_iter().flatten());
                }
            }
            out
        }
    }
}

/// The discovery thread: walks `proc_root` every `period` and offers the selected pids.
#[derive(Debug)]
pub struct Discovery {
    results: Receiver<BTreeSet<u32>>,
    stop: Arc<AtomicBool>,
}

impl Discovery {
    /// Starts the thread. It stops when the `Discovery` is dropped.
    ///
    /// # Errors
    /// When the thread cannot be spawned.
    pub fn start(proc_root: PathBuf, targets: Targets, period: Duration) -> std::io::Result<Self> {
        // One slot: a result the capture thread has not taken yet is replaced by a newer one.
        let (tx, results) = mpsc::sync_channel(1);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("discovery".into())
            .spawn(move || walk_until_stopped(&proc_root, &targets, period, &tx, &stopped))?;
        Ok(Self { results, stop })
    }

    /// The newest selection since the last call, if the thread made one.
    #[must_use]
    pub fn latest(&self) -> Option<BTreeSet<u32>> {
        self.results.try_iter().last()
    }
}

impl Drop for Discovery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn walk_until_stopped(
    proc_root: &Path,
    targets: &Targets,
    period: Duration,
    tx: &SyncSender<BTreeSet<u32>>,
    stop: &AtomicBool,
) {
    let mut previous = BTreeSet::new();
    while !stop.load(Ordering::Relaxed) {
        let selected = match targets {
            Targets::Comm(_) => select(targets, &read_command_names(proc_root)),
            Targets::Pids(roots) => select_pids(proc_root, roots, &previous),
        };
        previous.clone_from(&selected);
        match tx.try_send(selected) {
            // Full: the capture thread has not taken the previous one; the next walk replaces it.
            Ok(()) | Err(TrySendError::Full(_)) => {}
            Err(TrySendError::Disconnected(_)) => return,
        }
        std::thread::sleep(period);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_offers_selections_and_stops() {
        let me = std::process::id();
        let comm = read_processes(Path::new("/proc")).into_iter().find(|p| p.pid == me).expect("self").comm;
        let d = Discovery::start("/proc".into(), Targets::Comm(comm), Duration::from_millis(10)).unwrap();
        let mut got = None;
        for _ in 0..500 {
            if let Some(set) = d.latest() {
                got = Some(set);
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(got.expect("a selection within 5 s").contains(&me));
        drop(d);
    }

    proptest::proptest! {
        /// Whatever the line, no panic; a line as Linux prints it gives its comm and parent back.
        #[test]
        fn any_stat_line_is_read_without_panic(line in ".{0,80}", comm in "[^\n]{0,15}", ppid in 0u32..100_000) {
            let _ = parse_stat(1, &line);
            let p = parse_stat(7, &format!("7 ({comm}) S {ppid} 7 7 0 -1")).unwrap();
            proptest::prop_assert_eq!((p.ppid, p.comm), (ppid, comm));
        }
    }

    #[test]
    fn stat_with_odd_comm() {
        let p = parse_stat(7, "7 (a) b (c) S 3 7 7 0 -1").unwrap();
        assert_eq!(p, ProcInfo { pid: 7, ppid: 3, comm: "a) b (c".into() });
        assert_eq!(parse_stat(7, "garbage"), None);
    }

    #[test]
    fn selection() {
        let procs = vec![
            ProcInfo { pid: 1, ppid: 0, comm: "init".into() },
            ProcInfo { pid: 10, ppid: 1, comm: "haproxy".into() },
            ProcInfo { pid: 11, ppid: 10, comm: "haproxy".into() },
            ProcInfo { pid: 12, ppid: 11, comm: "helper".into() },
            ProcInfo { pid: 20, ppid: 1, comm: "nginx".into() },
        ];
        assert_eq!(select(&Targets::Comm("haproxy".into()), &procs), BTreeSet::from([10, 11]));
        assert_eq!(select(&Targets::Pids(vec![11, 99]), &procs), BTreeSet::from([11, 12]));
    }

    #[test]
    fn descendants_agree_with_the_full_walk() {
        let mut shell = std::process::Command::new("sh").args(["-c", "sleep 30 & wait"]).spawn().expect("sh");
        let (me, sh) = (std::process::id(), shell.id());
        let mut found = BTreeSet::new();
        for _ in 0..500 {
            found = read_descendants(Path::new("/proc"), &[sh]).expect("children files");
            if found.len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(found.len(), 2, "the shell and its sleep: {found:?}");
        let walked = select(&Targets::Pids(vec![sh]), &read_processes(Path::new("/proc")));
        assert_eq!(found, walked, "children files and the ppid walk find the same tree");
        assert!(
            read_descendants(Path::new("/proc"), &[me]).unwrap().is_superset(&found),
            "a tree reaches its grandchildren"
        );
        assert!(read_descendants(Path::new("/proc"), &[u32::MAX]).unwrap().is_empty(), "a gone root is skipped");
        let _ = shell.kill();
        let _ = shell.wait();
    }

    /// A fake `/proc`: `(pid, ppid, Some(children) or None for no children file)`.
    fn fake_proc(procs: &[(u32, u32, Option<&str>)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (pid, ppid, children) in procs {
            let task = root.path().join(pid.to_string()).join("task").join(pid.to_string());
            fs::create_dir_all(&task).unwrap();
            fs::write(root.path().join(pid.to_string()).join("stat"), format!("{pid} (p) S {ppid} 0")).unwrap();
            if let Some(children) = children {
                fs::write(task.join("children"), children).unwrap();
            }
        }
        root
    }

    #[test]
    fn a_worker_missing_from_one_children_read_stays_selected_while_it_lives() {
        // 10 is the master; 11's children read came back without 12 (it was mid-exit elsewhere);
        // 13 was selected before and is gone.
        let proc = fake_proc(&[(10, 1, Some("11")), (11, 10, Some("")), (12, 11, Some("")), (14, 1, Some(""))]);
        let previous = BTreeSet::from([10, 11, 12, 13, 14]);
        assert_eq!(select_pids(proc.path(), &[10], &previous), BTreeSet::from([10, 11, 12]));
        assert_eq!(select_pids(proc.path(), &[10], &BTreeSet::new()), BTreeSet::from([10, 11]));
    }

    #[test]
    fn without_children_files_the_full_walk_selects() {
        let proc = fake_proc(&[(10, 1, None), (11, 10, None), (12, 11, None), (14, 1, None)]);
        assert_eq!(read_descendants(proc.path(), &[10]), None);
        assert_eq!(select_pids(proc.path(), &[10], &BTreeSet::new()), BTreeSet::from([10, 11, 12]));
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        assert!(read_processes(Path::new("/proc")).iter().any(|p| p.pid == me));
        let by_stat = read_processes(Path::new("/proc")).into_iter().find(|p| p.pid == me).expect("self").comm;
        let by_comm = read_command_names(Path::new("/proc")).into_iter().find(|p| p.pid == me).expect("self").comm;
        assert_eq!(by_stat, by_comm, "both walks see the same command name");
    }
}
