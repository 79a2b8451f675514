//! What the capture loop keeps for each traced process, gathered so that a process that ended or
//! is no longer traced is forgotten in one call ([`PerProcess::forget`]). A new kind of
//! per-process state goes here, and `forget`'s exhaustive pattern does not compile until it is
//! forgotten too. The tracker's own per-connection state is forgotten beside it, with the probes'
//! filter, where targets change (`refresh_targets`), because the tracker needs the time to end
//! the process's open exchanges.

use super::opaque::{MarkSink, OpaqueMarks};
use super::pods::Pods;
use crate::batch::Batcher;
use crate::names::Names;
use crate::procfs::sockets::ListenAddrs;

pub struct PerProcess {
    /// Connections marked opaque in the probes, by process.
    pub opaque: OpaqueMarks,
    /// Bind addresses of listening sockets.
    pub listeners: ListenAddrs,
    /// Frontend, backend and server names from each process's configuration.
    pub names: Names,
    /// The span batch, which keeps each process's resource.
    pub batcher: Batcher,
    /// The pod of each process (Kubernetes).
    pub pods: Pods,
}

impl PerProcess {
    /// Forgets `pid` everywhere here; its opaque marks are also taken out of the probes' map
    /// (`marks`).
    pub fn forget(&mut self, marks: &mut impl MarkSink, pid: u32) {
        let Self { opaque, listeners, names, batcher, pods } = self;
        opaque.forget_process(marks, pid);
        listeners.forget_process(pid);
        names.forget_process(pid);
        batcher.forget_process(pid);
        pods.forget(pid);
    }
}
