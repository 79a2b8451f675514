//! TLS probe links dropped off the capture thread.
//!
//! Detaching a uprobe waits for the kernel's grace periods (`uprobe_unregister` synchronises RCU):
//! a quarter of a second per ended process on this machine's kernel, for its few links. Waited
//! for on the capture thread, every `HAProxy` process that ended stalled the ring's reader that
//! long, and under load the ring filled (`tests/tests/burst.rs`, 24 short-lived processes: 8 000
//! to 65 000 records lost in four runs of five). The links go to a thread of their own instead,
//! in the order the caller gives (opening probes first, see `tls_hooks`); dropping each one
//! detaches it.
//!
//! Until it is dropped, a link of an ended process matches nothing (its process is gone). A link
//! of a process that is no longer traced may still report a few of its calls; the tracker keeps
//! nothing for a process it does not trace. Such a process must not be hooked again while its old
//! links wait ([`Detacher::detaching`]): two sets of probes would report its plaintext twice. How many links wait is `tracetap_tls_links_detaching`.
//! Dropping the `Detacher` (the agent's shutdown) waits for the links still queued, so that no
//! tracefs event is left behind.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;

/// Anything that detaches a probe when dropped: a perf or uprobe-multi link, a tracefs event.
pub(super) type Detachable = Box<dyn Send>;

/// The sending end of the detaching thread.
pub(super) struct Detacher {
    /// `None` when the thread could not be started: links are then dropped where they are let go.
    tx: Option<mpsc::Sender<Batch>>,
    thread: Option<JoinHandle<()>>,
    /// Links handed over and not dropped yet.
    waiting: Arc<AtomicUsize>,
    /// Processes with links handed over and not dropped yet, with their number of batches.
    processes: Arc<Mutex<HashMap<u32, u32>>>,
}

/// Links of one process (`None`: of no single process, a bridge's), dropped first to last.
type Batch = (Option<u32>, Vec<Detachable>);

/// Counts a batch of process `pid` in or out of `processes`.
fn count_batch(processes: &Mutex<HashMap<u32, u32>>, pid: Option<u32>, arrived: bool) {
    let Some(pid) = pid else { return };
    let mut processes = processes.lock().unwrap_or_else(PoisonError::into_inner);
    if arrived {
        *processes.entry(pid).or_default() += 1;
    } else if let Some(batches) = processes.get_mut(&pid) {
        *batches -= 1;
        if *batches == 0 {
            processes.remove(&pid);
        }
    }
}

impl Detacher {
    /// Starts the thread (`tls-detach`); it ends when the `Detacher` is dropped.
    pub(super) fn start() -> Self {
        let (tx, rx) = mpsc::channel::<Batch>();
        let waiting = Arc::new(AtomicUsize::new(0));
        let processes = Arc::new(Mutex::new(HashMap::new()));
        let (dropped, done) = (Arc::clone(&waiting), Arc::clone(&processes));
        let spawned = std::thread::Builder::new().name("tls-detach".into()).spawn(move || {
            for (pid, links) in rx {
                for link in links {
                    drop(link);
                    dropped.fetch_sub(1, Ordering::Relaxed);
                }
                count_batch(&done, pid, false);
            }
        });
        match spawned {
            Ok(thread) => Self { tx: Some(tx), thread: Some(thread), waiting, processes },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the thread that detaches TLS probes; they are detached on the capture thread");
                Self { tx: None, thread: None, waiting, processes }
            }
        }
    }

    /// Links of process `pid` were handed over and are not all detached yet.
    pub(super) fn detaching(&self, pid: u32) -> bool {
        self.processes.lock().unwrap_or_else(PoisonError::into_inner).contains_key(&pid)
    }

    /// Links handed over and not detached yet.
    pub(super) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Detaches `links` of process `pid` (`None`: of no single process), first to last, off the
    /// calling thread.
    pub(super) fn detach(&self, pid: Option<u32>, links: Vec<Detachable>) {
        if links.is_empty() {
            return;
        }
        let count = links.len();
        self.waiting.fetch_add(count, Ordering::Relaxed);
        count_batch(&self.processes, pid, true);
        let unsent = match &self.tx {
            Some(tx) => tx.send((pid, links)).err().map(|mpsc::SendError((_, links))| links),
            None => Some(links),
        };
        if let Some(links) = unsent {
            drop(links);
            self.waiting.fetch_sub(count, Ordering::Relaxed);
            count_batch(&self.processes, pid, false);
        }
    }
}

impl Drop for Detacher {
    /// Waits for the links still queued (the agent's shutdown).
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::*;

    /// Notes its drop, by name, in a shared list.
    struct Noted(&'static str, Arc<Mutex<Vec<&'static str>>>);

    impl Drop for Noted {
        fn drop(&mut self) {
            self.1.lock().unwrap().push(self.0);
        }
    }

    /// Waits for the caller before its drop ends, and notes the thread that dropped it.
    struct Gate(mpsc::Receiver<()>, Arc<Mutex<Vec<std::thread::ThreadId>>>);

    impl Drop for Gate {
        fn drop(&mut self) {
            self.0.recv_timeout(Duration::from_secs(10)).expect("caller returned first");
            self.1.lock().unwrap().push(std::thread::current().id());
        }
    }

    #[test]
    fn links_are_dropped_off_the_caller_in_the_order_given() {
        let dropped = Arc::new(Mutex::new(Vec::new()));
        let detacher = Detacher::start();
        let (tx, rx) = mpsc::channel();
        let caller = std::thread::current().id();
        // The first link blocks its drop until the caller has returned from `detach`.
        let threads = Arc::new(Mutex::new(Vec::new()));
        detacher.detach(
            Some(7),
            vec![
                Box::new(Gate(rx, threads.clone())),
                Box::new(Noted("opening", dropped.clone())),
                Box::new(Noted("closing", dropped.clone())),
            ],
        );
        assert_eq!(detacher.waiting(), 3, "handed over, not dropped yet");
        assert!(detacher.detaching(7), "process 7's links wait");
        assert!(!detacher.detaching(8));
        tx.send(()).unwrap();
        // Dropping the detacher waits for what it still holds.
        drop(detacher);
        assert_eq!(*dropped.lock().unwrap(), ["opening", "closing"]);
        assert_ne!(threads.lock().unwrap().first(), Some(&caller), "dropped on the detaching thread");
    }

    #[test]
    fn a_process_is_detaching_until_its_last_batch_is_dropped() {
        let detacher = Detacher::start();
        let (tx, rx) = mpsc::channel();
        let threads = Arc::new(Mutex::new(Vec::new()));
        detacher.detach(Some(7), vec![Box::new(Gate(rx, threads))]);
        detacher.detach(None, vec![Box::new(1u8)]);
        assert!(detacher.detaching(7));
        tx.send(()).unwrap();
        for _ in 0..1000 {
            if !detacher.detaching(7) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!detacher.detaching(7), "its links are gone");
    }
}
