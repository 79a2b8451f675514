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
//! nothing for a process it does not trace.

use std::sync::mpsc;

/// Anything that detaches a probe when dropped: a perf or uprobe-multi link, a tracefs event.
pub(super) type Detachable = Box<dyn Send>;

/// The sending end of the detaching thread.
pub(super) struct Detacher {
    /// `None` when the thread could not be started: links are then dropped where they are let go.
    tx: Option<mpsc::Sender<Vec<Detachable>>>,
}

impl Detacher {
    /// Starts the thread (`tls-detach`); it ends when the `Detacher` is dropped.
    pub(super) fn start() -> Self {
        let (tx, rx) = mpsc::channel::<Vec<Detachable>>();
        let spawned = std::thread::Builder::new().name("tls-detach".into()).spawn(move || {
            // A `Vec` drops its elements first to last.
            for links in rx {
                drop(links);
            }
        });
        match spawned {
            Ok(_) => Self { tx: Some(tx) },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the thread that detaches TLS probes; they are detached on the capture thread");
                Self { tx: None }
            }
        }
    }

    /// Detaches `links`, first to last, off the calling thread.
    pub(super) fn detach(&self, links: Vec<Detachable>) {
        if links.is_empty() {
            return;
        }
        if let Some(tx) = &self.tx
            && let Err(mpsc::SendError(links)) = tx.send(links)
        {
            drop(links);
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
        detacher.detach(vec![
            Box::new(Gate(rx, threads.clone())),
            Box::new(Noted("opening", dropped.clone())),
            Box::new(Noted("closing", dropped.clone())),
        ]);
        tx.send(()).unwrap();
        drop(detacher);
        for _ in 0..1000 {
            if dropped.lock().unwrap().len() == 2 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(*dropped.lock().unwrap(), ["opening", "closing"]);
        assert_ne!(threads.lock().unwrap().first(), Some(&caller), "dropped on the detaching thread");
    }
}
