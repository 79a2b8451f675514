//! tracetap: traces `HAProxy` from the outside. See docs/ARCHITECTURE.md for the data flow:
//! capture (eBPF) -> proxy (streams, pairing, linking) -> sampling -> spans -> export.
#![deny(unsafe_code)]

pub mod admin;
pub mod batch;
pub mod capture;
pub mod cli;
pub mod config;
pub mod config_error;
pub mod encode;
pub mod export;
pub mod k8s;
pub mod metrics;
pub mod names;
pub mod pipeline;
pub mod procfs;
pub mod rate_limit;
pub mod resource;
pub mod sampling;
pub mod snippet;
pub mod spans;
pub mod tail;
pub mod target;
pub mod telemetry;
pub mod timeline;
pub mod view;
