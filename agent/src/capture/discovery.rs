//! Finds the processes to trace by walking `/proc`: every process with the target command name,
//! or the configured pids and their descendants (`HAProxy`'s master forks its workers).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

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
    let Ok(dir) = fs::read_dir(proc_root) else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| parse_stat(pid, &fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?))
        .collect()
}

/// Parses `/proc/PID/stat`: `pid (comm) state ppid ...`, where comm may itself hold `)` or spaces.
#[must_use]
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn reads_this_process() {
        let me = std::process::id();
        assert!(read_processes(Path::new("/proc")).iter().any(|p| p.pid == me));
    }
}
