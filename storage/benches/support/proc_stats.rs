//! Process figures for the benchmarks, from /proc/self: CPU time of every thread, RSS, and the
//! bytes a directory holds. Shared by the storage and the agent benchmarks (`#[path]` include).

use std::path::Path;

/// User + system CPU of the whole process (all threads), from /proc/self/stat.
pub fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after_comm = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); index 0 here is field 3.
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    ticks as f64 / 100.0
}

/// A `kB` field of /proc/self/status (`VmRSS:`, `VmHWM:`), in KiB.
pub fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("status field")
}

/// Bytes of every file under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .expect("store dir")
        .flatten()
        .map(|e| {
            let meta = e.metadata().expect("metadata");
            if meta.is_dir() { dir_bytes(&e.path()) } else { meta.len() }
        })
        .sum()
}
