//! What tracetap knows about the proxy it watches: HTTP/1 and HTTP/2 byte streams (cleartext, or
//! TLS plaintext) as syscalls deliver them, request/response pairing (in order for HTTP/1, by
//! stream for HTTP/2), and the links between the frontend request `HAProxy` read and the backend
//! requests it wrote for it. Pure: no eBPF, no async runtime, no clock.
#![forbid(unsafe_code)]

pub mod cgroup;
pub mod exchange;
pub mod framing;
pub mod h2;
pub mod haproxy_config;
pub mod haproxy_runtime;
pub mod haproxy_words;
pub mod head;
pub mod proxy_protocol;
pub mod rejected;
pub mod sampled_out;
pub mod termination;
pub mod timers;
pub mod trace_context;
pub mod tracker;

pub use exchange::{ClientExchange, Outcome, ServerExchange, TlsInfo};
pub use framing::Chunk;
pub use head::{HttpVersion, RequestHead, ResponseHead, TraceparentField};
pub use timers::Timers;
pub use tracker::{Limits, Op, OpaqueMark, SyscallEvent, Tracker, TrackerStats};
