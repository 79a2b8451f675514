//! What tracetap knows about the proxy it watches: HTTP/1 byte streams as syscalls deliver them,
//! request/response pairing, and the links between the frontend request `HAProxy` read and the
//! backend requests it wrote for it. Pure: no eBPF, no async runtime, no clock.
#![forbid(unsafe_code)]

pub mod cgroup;
pub mod exchange;
pub mod framing;
pub mod haproxy_config;
pub mod head;
pub mod proxy_protocol;
pub mod trace_context;
pub mod tracker;

pub use exchange::{ClientExchange, Outcome, ServerExchange};
pub use framing::Chunk;
pub use head::{RequestHead, ResponseHead, TraceparentField};
pub use tracker::{Limits, Op, OpaqueMark, SyscallEvent, Tracker, TrackerStats};
