//! Opening the tail store, so that a store the agent cannot read never stops it: not at start, not
//! in a crash loop.
//!
//! Layout in `TRACETAP_STATE_DIR`: the store in `tail/`, the journal of what waits in memory in
//! `journal/` (see `journal`; its damaged segments are set aside one by one, in
//! `journal/quarantine/`), stores set aside in
//! `quarantine/<unix ns>/` (the newest [`KEEP_QUARANTINED`] are kept for a post-mortem). A store
//! that fails to open, holds another format, or holds a record that does not decode (recovery reads
//! every record) is renamed aside, counted in `tracetap_tail_store_quarantined_total` and logged,
//! and a fresh one is opened. What it held is lost: pending traces, and kept traces not yet
//! exported.
//!
//! sled panics on some damage instead of returning an error, so opening and recovery run under
//! `catch_unwind`: a panic there is a failure to open like any other.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use tracetap_storage::{SledOptions, SledStore};

use super::engine::{Engine, Limits};
use super::journal::{Journal, Sync};
use super::policy::PolicySet;
use crate::metrics::{self, Metrics};

/// Quarantined stores kept; older ones are removed.
pub const KEEP_QUARANTINED: usize = 2;

/// Where the store lives in the state directory.
#[must_use]
pub fn store_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("tail")
}

/// Where the journal lives in the state directory.
#[must_use]
pub fn journal_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("journal")
}

fn quarantine_root(state_dir: &Path) -> PathBuf {
    state_dir.join("quarantine")
}

/// Opens the store and recovers the engine from it; a store that cannot be read is quarantined and
/// a fresh one opened. `None` when even a fresh store cannot be opened (a full or read-only disk):
/// logged, and the caller counts what it cannot buffer. The engine's gauges are published before
/// it is returned: `/metrics` never shows an empty tail stage while recovered traces wait (the
/// tail thread's first tick comes 100 ms later).
pub fn open_engine(
    state_dir: &Path,
    options: SledOptions,
    journal: Option<Sync>,
    policies: &PolicySet,
    limits: Limits,
    resource: &[(String, String)],
    metrics: &Metrics,
) -> Option<Engine<SledStore>> {
    if let Err(e) = move_root_layout(state_dir) {
        tracing::warn!(error = %e, dir = %state_dir.display(), "moving an older tail store into tail/");
    }
    let dir = store_dir(state_dir);
    // Opened for each attempt: one that fails leaves the journal on disk for the next.
    let open_journal = || {
        let sync = journal?;
        match Journal::open(&journal_dir(state_dir), sync, super::unix_now_ns()) {
            Ok(opened) => Some(opened),
            Err(e) => {
                metrics::add(&metrics.tail_journal_write_errors, 1);
                tracing::error!(
                    error = %e,
                    dir = %journal_dir(state_dir).display(),
                    "the tail journal cannot be opened: tail sampling goes on, but a crash loses what waits in memory"
                );
                None
            }
        }
    };
    // Err((why, damaged)): `damaged` when the store's contents are at fault (quarantine them), not
    // the system (another process holding its lock, permissions, descriptors: leave it alone).
    let attempt = || -> Result<Engine<SledStore>, (String, bool)> {
        let opened = catch_unwind(AssertUnwindSafe(|| {
            let store = SledStore::open(&dir, options)?;
            let journal = open_journal();
            Engine::open_journaled(store, journal, policies.clone(), limits, resource.to_vec(), super::unix_now_ns())
        }));
        match opened {
            Ok(Ok(engine)) => Ok(engine),
            Ok(Err(e)) => Err((e.to_string(), e.is_damage())),
            Err(panic) => Err((format!("the store library panicked: {}", panic_message(&*panic)), true)),
        }
    };
    let published = |mut engine: Engine<SledStore>| {
        engine.publish(metrics);
        engine
    };
    let why = match attempt() {
        Ok(engine) => return Some(published(engine)),
        Err((why, true)) => why,
        Err((why, false)) => {
            tracing::error!(
                reason = %why,
                dir = %dir.display(),
                "the tail store cannot be opened (another agent using it? permissions?): tail sampling is off, every span is counted as lost"
            );
            return None;
        }
    };
    metrics::add(&metrics.tail_store_quarantined, 1);
    match quarantine(state_dir) {
        Ok(aside) => tracing::error!(
            reason = %why,
            moved_to = %aside.display(),
            "the tail store could not be read: set aside, starting with an empty one (its pending traces and unexported kept traces are lost)"
        ),
        Err(e) => {
            tracing::error!(reason = %why, error = %e, dir = %dir.display(), "the tail store could not be read, nor set aside");
            return None;
        }
    }
    match attempt() {
        Ok(engine) => Some(published(engine)),
        Err((e, _)) => {
            tracing::error!(reason = %e, dir = %dir.display(), "a fresh tail store cannot be opened: tail sampling is off, every span is counted as lost");
            None
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned())
}

/// Renames the store aside; returns where it went. Keeps the newest [`KEEP_QUARANTINED`].
pub fn quarantine(state_dir: &Path) -> std::io::Result<PathBuf> {
    let root = quarantine_root(state_dir);
    std::fs::create_dir_all(&root)?;
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let aside = root.join(stamp.to_string());
    std::fs::rename(store_dir(state_dir), &aside)?;
    let mut kept: Vec<(u128, PathBuf)> = std::fs::read_dir(&root)?
        .filter_map(Result::ok)
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect();
    kept.sort_unstable_by_key(|(stamp, _)| std::cmp::Reverse(*stamp));
    for (_, old) in kept.into_iter().skip(KEEP_QUARANTINED) {
        if let Err(e) = std::fs::remove_dir_all(&old) {
            tracing::warn!(error = %e, dir = %old.display(), "removing an old quarantined tail store");
        }
    }
    Ok(aside)
}

/// Stores written before the `tail/` subdirectory have sled's files at the state directory's root
/// (`conf`, `db`, `blobs/`, `snap.*`): they move into `tail/`, so that their traces are recovered
/// and the state directory (often a mount point, which cannot be renamed) never has to be.
///
/// `conf` moves last: a move cut short by a crash leaves `conf` at the root, and the next start
/// finishes it (a `tail/` holding a `conf` of its own is never overwritten).
fn move_root_layout(state_dir: &Path) -> std::io::Result<()> {
    let dir = store_dir(state_dir);
    if !state_dir.join("conf").is_file() || dir.join("conf").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(state_dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if matches!(name, "db" | "blobs") || name.starts_with("snap.") {
            std::fs::rename(entry.path(), dir.join(name))?;
        }
    }
    std::fs::rename(state_dir.join("conf"), dir.join("conf"))?;
    tracing::info!(dir = %dir.display(), "moved the tail store into its own directory");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tail::policy::{NamedPolicy, Policy};

    fn limits() -> Limits {
        Limits {
            grace_ns: 60_000_000_000,
            decision_wait_ns: 60_000_000_000,
            max_disk_bytes: 1 << 30,
            decision_cache: 100,
            export_batch_spans: 10,
            spill_after_ns: 0,
            max_memory_bytes: 1 << 30,
        }
    }

    /// Waits until no handle of this process holds the sled store in `dir`: sled's flusher thread
    /// lets go of the directory's lock a moment after the last handle is dropped, so a store
    /// reopened at once in the same process may find it still held (a restarted agent is another
    /// process and never does). Checked with the lock sled takes (`flock` on `db`).
    fn wait_released(dir: &Path) {
        let db = dir.join("db");
        for _ in 0..1000 {
            let Ok(file) = std::fs::File::open(&db) else { return };
            if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
                return; // Closing `file` lets go of the lock taken to look.
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("sled still holds {} after 5 s", db.display());
    }

    fn open(state: &Path, metrics: &Metrics) -> Option<Engine<SledStore>> {
        let policies = PolicySet::new(vec![NamedPolicy { name: "all".into(), policy: Policy::AlwaysSample }]);
        open_engine(state, SledOptions::default(), None, &policies, limits(), &[], metrics)
    }

    #[test]
    fn garbage_in_the_store_is_set_aside_and_a_fresh_store_opened() {
        let state = tempfile::tempdir().unwrap();
        let metrics = Metrics::default();
        drop(open(state.path(), &metrics).expect("a new store opens"));
        wait_released(&store_dir(state.path()));
        assert_eq!(metrics.tail_store_quarantined.load(std::sync::atomic::Ordering::Relaxed), 0);
        // Garbage over every file sled wrote.
        for entry in std::fs::read_dir(store_dir(state.path())).unwrap() {
            let path = entry.unwrap().path();
            if path.is_file() {
                std::fs::write(&path, vec![0xa5; 4096]).unwrap();
            }
        }
        let engine = open(state.path(), &metrics).expect("a fresh store after the quarantine");
        assert_eq!(engine.pending_traces(), 0);
        assert_eq!(metrics.tail_store_quarantined.load(std::sync::atomic::Ordering::Relaxed), 1);
        let aside: Vec<_> = std::fs::read_dir(quarantine_root(state.path())).unwrap().collect();
        assert_eq!(aside.len(), 1, "the damaged store is kept aside for a post-mortem");
    }

    #[test]
    fn a_store_another_process_holds_is_not_quarantined() {
        let state = tempfile::tempdir().unwrap();
        let metrics = Metrics::default();
        drop(open(state.path(), &metrics).expect("a new store opens"));
        wait_released(&store_dir(state.path()));
        // Held open elsewhere (sled locks its directory): an I/O error, not damage.
        let held = SledStore::open(&store_dir(state.path()), SledOptions::default()).unwrap();
        assert!(open(state.path(), &metrics).is_none());
        assert_eq!(metrics.tail_store_quarantined.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert!(!quarantine_root(state.path()).exists(), "a store in use is never set aside");
        drop(held);
        wait_released(&store_dir(state.path()));
        assert!(open(state.path(), &metrics).is_some());
    }

    #[test]
    fn only_the_newest_quarantined_stores_are_kept() {
        let state = tempfile::tempdir().unwrap();
        for _ in 0..4 {
            std::fs::create_dir_all(store_dir(state.path())).unwrap();
            quarantine(state.path()).unwrap();
        }
        assert_eq!(std::fs::read_dir(quarantine_root(state.path())).unwrap().count(), KEEP_QUARANTINED);
    }

    #[test]
    fn a_store_at_the_state_directorys_root_moves_into_tail() {
        let state = tempfile::tempdir().unwrap();
        {
            let mut store = SledStore::open(state.path(), SledOptions::default()).unwrap();
            let spans: &[&[u8]] = &[b"\0\0\0\x01span"];
            let fragment = tracetap_storage::Fragment {
                trace: [9; 16],
                first_seen_unix_ns: super::super::unix_now_ns(),
                root_ended_unix_ns: None,
                spans,
            };
            tracetap_storage::TailStore::append(&mut store, 1, &[fragment]).unwrap();
            tracetap_storage::TailStore::flush(&mut store).unwrap();
        }
        wait_released(state.path());
        let metrics = Metrics::default();
        let engine = open(state.path(), &metrics).unwrap();
        assert_eq!(engine.pending_traces(), 1, "the older store's pending trace is recovered");
        assert!(!state.path().join("conf").exists());
        let pending = metrics.tail_traces_pending.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(pending, 1, "the gauges tell what was recovered as soon as the engine is open");
    }
}
