//! Configuration: a pure parse of a key/value source (the process environment in production, a
//! map in tests) into a validated [`Config`]. Every bad value is a [`ConfigError`] that names the
//! variable and says what it accepts; `main` turns it into exit status 2.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tracetap_ebpf_common::{COMM_BYTES, MAX_CAPTURE_BYTES, MIN_CAPTURE_BYTES};

pub use crate::config_error::{ConfigError, ConfigErrors, parse_flag};
use crate::export::settings::{self, ExportSettings, Signal};
use crate::k8s::selector::LabelSelector;
use crate::sampling::{Sampler, threshold_for};
use crate::tail::journal::Sync;
use crate::tail::policy::{NamedPolicy, Policy};
use crate::tail::{PolicySource, TailConfig};
use crate::telemetry::{self, TelemetrySettings};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;

/// Which processes to trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targets {
    /// Every process with this command name (at most 15 bytes).
    Comm(String),
    /// These processes and their descendants (`HAProxy`'s master-worker mode forks its workers).
    Pids(Vec<u32>),
}

/// What the attached programs do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeMode {
    /// Capture and trace (the default).
    Capture,
    /// Attach programs to the same hooks that return at once and capture nothing: the cost a
    /// traced process pays for the hooks alone, which `make bench` measures as the floor.
    Floor,
}

/// Where the TLS probes go (`TRACETAP_TLS_PROBES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsProbes {
    /// On the calls inside `SSL_read`/`SSL_write` when the library's code is recognised, else at
    /// the functions' entries and returns (see `capture/tls.rs`).
    Auto,
    /// Always at the functions' entries and returns.
    Entry,
    /// No TLS probes: TLS connections stay opaque (counted, not traced).
    Off,
}

/// How the TLS probes reach the kernel (`TRACETAP_TLS_ROUTE`; see `capture/uprobes.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsRoute {
    /// The first route whose self-test attaches, in the order below.
    Auto,
    /// Only uprobe-multi links (Linux 6.6+, `CAP_BPF` and `CAP_PERFMON`).
    UprobeMulti,
    /// Only perf uprobes (`CAP_SYS_ADMIN`).
    Perf,
    /// Only tracefs uprobe events opened as tracepoint perf events.
    Tracefs,
}

impl TlsRoute {
    /// The value of `TRACETAP_TLS_ROUTE` that names this one route; `None` for `Auto`.
    #[must_use]
    pub fn name(self) -> Option<&'static str> {
        match self {
            Self::Auto => None,
            Self::UprobeMulti => Some("uprobe_multi"),
            Self::Perf => Some("perf"),
            Self::Tracefs => Some("tracefs"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Where spans go (`OTEL_EXPORTER_OTLP_*`); no endpoint means JSON lines on stdout.
    pub export: ExportSettings,
    /// The agent's own metrics: `/metrics`, OTLP, both or neither (`OTEL_METRICS_EXPORTER`).
    pub telemetry: TelemetrySettings,
    pub service_name: String,
    pub resource_attributes: Vec<(String, String)>,
    pub sampler: Sampler,
    pub schedule_delay: Duration,
    pub max_queue_size: usize,
    pub max_export_batch_size: usize,
    pub admin_addr: SocketAddr,
    pub capture_bytes: u32,
    pub targets: Targets,
    pub ring_bytes: u32,
    pub probe_stats: bool,
    /// `TRACETAP_PROBE_MODE`: what the attached programs do (`floor` is for the benchmark).
    pub probe_mode: ProbeMode,
    /// `TRACETAP_TLS_PROBES`.
    pub tls_probes: TlsProbes,
    /// `TRACETAP_TLS_ROUTE`.
    pub tls_route: TlsRoute,
    pub log_filter: String,
    /// Tail sampling, when `TRACETAP_TAIL_ENABLED=true`.
    pub tail: Option<TailConfig>,
    /// `NODE_NAME` (the `DaemonSet` sets it from the downward API): `k8s.node.name`, and the node
    /// whose pods the pod watch follows.
    pub node_name: Option<String>,
    /// `TRACETAP_K8S_POD_SELECTOR`: trace only `HAProxy` processes in pods with matching labels.
    pub pod_selector: Option<LabelSelector>,
    /// Most characters of a string span attribute value: `OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`,
    /// else `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`; `None` (the default) for no limit.
    pub attribute_value_length_limit: Option<usize>,
    /// `TRACETAP_EXCHANGE_IDLE_TIMEOUT`: an exchange without activity for this long is expired.
    /// Its nanoseconds fit in a `u64` (the tracker's clock).
    pub exchange_idle_timeout: Duration,
    /// `TRACETAP_HAPROXY_RUNTIME_API`: read server names from `HAProxy`'s runtime API (`show
    /// servers state` on its `stats socket`) rather than from its configuration file alone.
    pub runtime_api: bool,
    /// `TRACETAP_REJECTED_SPANS_PER_SECOND`: most SERVER spans per second for requests `HAProxy`
    /// rejected as malformed (0: none); the rest are counted.
    pub rejected_spans_per_second: u32,
}

/// Every variable the agent reads, with its default and meaning. The table in docs/configuration.md is this list,
/// and `tracetap --help` prints it. The parser of this module reads its defaults from here (`Source::or_default`):
/// a default written as a value is written once; one written as a description (`(unset)` and the like) is the
/// parser's to handle.
pub const VARIABLES: &[(&str, &str, &str)] = &[
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "(unset: JSON lines on stdout)",
        "base URL, `http://` or `https://`; OTLP/HTTP spans go to `<url>/v1/traces`; an `http://` gRPC URL without a port means 4317",
    ),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "(unset)", "full URL for traces; wins over the base URL"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf", "`http/protobuf` or `grpc` (`_TRACES_` variant wins)"),
    (
        "OTEL_EXPORTER_OTLP_HEADERS",
        "(none)",
        "`key=value,...` headers sent with every export (values URL-decoded; `_TRACES_` variant wins)",
    ),
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "10000", "ms per export request (`_TRACES_` variant wins)"),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "none", "`none` or `gzip` (`_TRACES_` variant wins)"),
    (
        "OTEL_EXPORTER_OTLP_CERTIFICATE",
        "(system roots)",
        "PEM file of the CA certificates to trust for an `https` endpoint instead of the system's (`_TRACES_` variant wins)",
    ),
    (
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        "(none)",
        "PEM client certificate chain for mutual TLS, with `OTEL_EXPORTER_OTLP_CLIENT_KEY` (`_TRACES_` variant wins)",
    ),
    ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "(none)", "PEM private key of the client certificate (`_TRACES_` variant wins)"),
    (
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "(`OTEL_EXPORTER_OTLP_PROTOCOL`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "(`OTEL_EXPORTER_OTLP_HEADERS`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "(`OTEL_EXPORTER_OTLP_TIMEOUT`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
        "(`OTEL_EXPORTER_OTLP_COMPRESSION`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        "(`OTEL_EXPORTER_OTLP_CERTIFICATE`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        "(`OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        "(`OTEL_EXPORTER_OTLP_CLIENT_KEY`)",
        "the same for spans only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
        "(`<base URL>/v1/metrics`, else `http://localhost:4318/v1/metrics`)",
        "full URL for the agent's own metrics (with `OTEL_METRICS_EXPORTER=otlp`); without any endpoint they go to the OTLP default on this host, while spans go to stdout",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        "(`OTEL_EXPORTER_OTLP_PROTOCOL`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        "(`OTEL_EXPORTER_OTLP_HEADERS`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
        "(`OTEL_EXPORTER_OTLP_TIMEOUT`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
        "(`OTEL_EXPORTER_OTLP_COMPRESSION`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
        "(`OTEL_EXPORTER_OTLP_CERTIFICATE`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
        "(`OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
        "(`OTEL_EXPORTER_OTLP_CLIENT_KEY`)",
        "the same for the agent's own metrics only; wins over the general variable",
    ),
    (
        "OTEL_METRICS_EXPORTER",
        "prometheus",
        "the agent's own metrics: `prometheus` (text on /metrics), `otlp` (to the OTLP endpoint, `/v1/metrics`; `_METRICS_` variants of the export variables win), both comma-separated, or `none`",
    ),
    ("OTEL_METRIC_EXPORT_INTERVAL", "60000", "ms between exports of the agent's own metrics over OTLP"),
    ("OTEL_SERVICE_NAME", "haproxy", "`service.name` of the resource"),
    ("OTEL_RESOURCE_ATTRIBUTES", "(none)", "`key=value,...` extra resource attributes"),
    (
        "OTEL_TRACES_SAMPLER",
        "parentbased_always_on",
        "always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio",
    ),
    (
        "OTEL_TRACES_SAMPLER_ARG",
        "1.0",
        "ratio in [0, 1] for the ratio samplers (consistent probability sampling; kept spans carry `ot=th:` in tracestate)",
    ),
    ("OTEL_BSP_SCHEDULE_DELAY", "5000", "ms between exports of a partial batch"),
    (
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "2048",
        "spans waiting for export in encoded batches; a batch that does not fit is dropped and counted",
    ),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "512", "spans per export request (at most the queue size)"),
    ("TRACETAP_ADMIN_ADDR", "127.0.0.1:9464", "address of /readyz, /healthz, /metrics"),
    ("TRACETAP_CAPTURE_BYTES", "4096", "payload bytes copied per syscall, 64..=16384"),
    ("TRACETAP_TARGET_COMM", "haproxy", "trace every process with this command name (max 15 bytes)"),
    (
        "TRACETAP_TARGET_PIDS",
        "(unset)",
        "comma-separated pids to trace with their children, instead of by command name",
    ),
    ("TRACETAP_RING_BYTES", "8388608", "ring buffer size: a power of two, at least 65536"),
    (
        "TRACETAP_HAPROXY_RUNTIME_API",
        "true",
        "`false` stops reading server names from HAProxy's runtime API (`show info;show servers state` on the configuration's `stats socket`, read-only: every 2 s, and every 200 ms to 1 s while kept spans wait for a table read after their request); names then come from the configuration file only",
    ),
    (
        "TRACETAP_PROBE_STATS",
        "false",
        "`true` enables the kernel's BPF run-time statistics (about 20 ns per probe run) and exports them in /metrics",
    ),
    (
        "TRACETAP_PROBE_MODE",
        "capture",
        "`floor` attaches programs that return at once (the syscall hooks and the TLS probes' points) and traces nothing: the hooks' own cost, for benchmarks",
    ),
    (
        "TRACETAP_TLS_PROBES",
        "auto",
        "where the TLS library probes go: `auto` (on the internal call of `SSL_read`/`SSL_write` where the agent recognises the code (Debian's x86_64 OpenSSL 3 builds), which costs a breakpoint and no single-step, else at function entry and return, as on arm64), `entry` (always entry and return) or `off` (TLS connections are not traced)",
    ),
    (
        "TRACETAP_TLS_ROUTE",
        "auto",
        "how the TLS probes reach the kernel: `auto` (the first that works here, tried at start in this order), `uprobe_multi` (uprobe-multi links, Linux 6.6+, CAP_BPF and CAP_PERFMON), `perf` (perf uprobes, CAP_SYS_ADMIN) or `tracefs` (uprobe events in tracefs opened as tracepoints: a writable tracefs, and kernel.perf_event_paranoid 2 or less on Linux 6.1)",
    ),
    (
        "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "(unset: no limit)",
        "most characters of a string span attribute value; longer values are cut",
    ),
    (
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "(unset: no limit)",
        "the same for span attributes; wins over `OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`",
    ),
    (
        "TRACETAP_REJECTED_SPANS_PER_SECOND",
        "10",
        "most SERVER spans a second for requests HAProxy rejects as malformed (bursts of as many); the rest counted in `tracetap_rejected_request_spans_dropped_total`; 0 for none",
    ),
    (
        "TRACETAP_EXCHANGE_IDLE_TIMEOUT",
        "300s",
        "an exchange with no traffic for this long ends, exported with `error.type` `timeout` (`ms`, `s` or `m`)",
    ),
    ("TRACETAP_LOG", "info", "log filter (tracing-subscriber EnvFilter syntax), logs go to stderr"),
    (
        "NODE_NAME",
        "(unset)",
        "the Kubernetes node's name (the DaemonSet sets it from the downward API): `k8s.node.name`; with a cluster configuration, also starts the watch of this node's pods",
    ),
    (
        "TRACETAP_K8S_POD_SELECTOR",
        "(unset: every pod)",
        "label selector (`kubectl -l` syntax); only HAProxy processes in matching pods are traced",
    ),
    (
        "TRACETAP_TAIL_ENABLED",
        "false",
        "`true` buffers kept spans in the tail store until the tail policies decide their trace",
    ),
    ("TRACETAP_STATE_DIR", "/var/lib/tracetap", "directory of the tail store (kept across restarts)"),
    (
        "TRACETAP_TAIL_GRACE",
        "500ms",
        "wait after a trace's root span reached the tail stage before deciding it (`ms`, `s` or `m`)",
    ),
    ("TRACETAP_TAIL_DECISION_WAIT", "30s", "longest wait from a trace's first span to its decision"),
    ("TRACETAP_TAIL_KEEP_ERRORS", "true", "keep every trace with a span in error (policy `keep_errors`)"),
    ("TRACETAP_TAIL_LATENCY_MS", "(unset)", "keep every trace at least this long, in ms (policy `latency`)"),
    (
        "TRACETAP_TAIL_RATIO",
        "0.0",
        "keep this share of the other traces, consistently by trace id (policy `probabilistic`)",
    ),
    (
        "TRACETAP_TAIL_MAX_SPANS_PER_SEC",
        "(unset)",
        "also keep traces while at most this many spans per second are kept so (policy `rate_limiting`)",
    ),
    (
        "TRACETAP_TAIL_POLICY_FILE",
        "(unset)",
        "YAML or JSON policy file in the Collector's `tail_sampling` shape; replaces the four variables above",
    ),
    (
        "TRACETAP_TAIL_SPILL_AFTER",
        "5s",
        "a trace still undecided this long after its first span leaves memory for the store (`ms`, `s` or `m`)",
    ),
    (
        "TRACETAP_TAIL_MAX_MEMORY_BYTES",
        "67108864",
        "bytes of spans of traces waiting in memory; past it the oldest go to the store (0: every trace waits in the store)",
    ),
    (
        "TRACETAP_TAIL_MAX_DISK_BYTES",
        "1073741824",
        "bytes of spans in the store and the journal; past it the store's oldest traces are decided early, then the journal's oldest segments go (counted)",
    ),
    (
        "TRACETAP_TAIL_JOURNAL",
        "sync",
        "what waits in memory is journaled every 100 ms so that a crash loses at most that: `sync` (fdatasync each write: so does a power loss), `nosync` (a power loss can lose more), `off`",
    ),
    (
        "TRACETAP_TAIL_DECISION_CACHE",
        "100000",
        "decisions remembered (on disk too, for traces that went to the store) so that late spans follow them",
    ),
];

/// The default [`VARIABLES`] writes for `var`, as a value the parser reads.
///
/// # Panics
/// When `var` is not in the table, or its default is a description (`(unset)` and the like): a
/// defect of this module, which its tests find (they read every variable with its default).
fn written_default(var: &str) -> &'static str {
    let (_, default, _) =
        VARIABLES.iter().find(|(v, _, _)| *v == var).unwrap_or_else(|| panic!("{var} is not in VARIABLES"));
    assert!(!default.starts_with('('), "{var}'s default in VARIABLES is a description, not a value: {default}");
    default
}

fn err(var: &'static str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError::new(var, value, expected)
}

/// Reads variables through `get`, treating empty values as unset (as the `OTel` spec asks).
struct Source<F> {
    get: F,
}

impl<F: Fn(&str) -> Option<String>> Source<F> {
    fn get(&self, var: &'static str) -> Option<String> {
        (self.get)(var).filter(|v| !v.trim().is_empty())
    }

    /// The variable's value, else its default as [`VARIABLES`] writes it: a default is written
    /// once, in the table `--help` and docs/configuration.md show.
    fn or_default(&self, var: &'static str) -> String {
        self.get(var).unwrap_or_else(|| written_default(var).to_owned())
    }

    fn parse<T: std::str::FromStr>(&self, var: &'static str, expected: &str) -> Result<T, ConfigError> {
        let v = self.or_default(var);
        v.trim().parse().map_err(|_| err(var, &v, expected))
    }

    /// A value that has no default: `None` when unset.
    fn optional<T: std::str::FromStr>(&self, var: &'static str, expected: &str) -> Result<Option<T>, ConfigError> {
        self.get(var).map(|v| v.trim().parse().map_err(|_| err(var, &v, expected))).transpose()
    }

    fn millis(&self, var: &'static str) -> Result<Duration, ConfigError> {
        self.parse(var, "a whole number of milliseconds").map(Duration::from_millis)
    }

    fn flag(&self, var: &'static str) -> Result<bool, ConfigError> {
        parse_flag(var, Some(&self.or_default(var)), false)
    }

    /// A positive duration with a unit: `500ms`, `2s`, `1m`.
    fn duration(&self, var: &'static str) -> Result<Duration, ConfigError> {
        let v = self.or_default(var);
        let text = v.trim();
        let expected = "a positive duration with a unit, such as 500ms, 2s or 1m";
        let (number, scale_ms) = if let Some(n) = text.strip_suffix("ms") {
            (n, 1)
        } else if let Some(n) = text.strip_suffix('s') {
            (n, 1_000)
        } else if let Some(n) = text.strip_suffix('m') {
            (n, 60_000)
        } else {
            return Err(err(var, &v, expected));
        };
        match number.trim().parse::<u64>() {
            Ok(n) if n > 0 => Ok(Duration::from_millis(n.saturating_mul(scale_ms))),
            _ => Err(err(var, &v, expected)),
        }
    }
}

/// Both variables are checked, so a typo in either is reported; the span one wins.
fn parse_value_length_limit(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<Option<usize>, ConfigError> {
    let expected = "a whole number of characters (unset for no limit)";
    let span = src.optional("OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT", expected)?;
    let general = src.optional("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", expected)?;
    Ok(span.or(general))
}

/// The tracker counts time in `u64` nanoseconds: a longer timeout (over 584 years) would wrap.
fn parse_exchange_idle_timeout(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<Duration, ConfigError> {
    let var = "TRACETAP_EXCHANGE_IDLE_TIMEOUT";
    let timeout = src.duration(var)?;
    if u64::try_from(timeout.as_nanos()).is_err() {
        return Err(err(
            var,
            &format!("{timeout:?}"),
            "a positive duration with a unit, such as 30s or 5m, shorter than 584 years",
        ));
    }
    Ok(timeout)
}

fn parse_pod_selector(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<Option<LabelSelector>, ConfigError> {
    let Some(text) = src.get("TRACETAP_K8S_POD_SELECTOR") else { return Ok(None) };
    LabelSelector::parse(&text).map(Some).map_err(|why| {
        err("TRACETAP_K8S_POD_SELECTOR", &text, format!("a label selector such as app=haproxy,tier in (edge): {why}"))
    })
}

/// The variables that build tail policies without a policy file.
const ENV_POLICY_VARS: [&str; 4] =
    ["TRACETAP_TAIL_KEEP_ERRORS", "TRACETAP_TAIL_LATENCY_MS", "TRACETAP_TAIL_RATIO", "TRACETAP_TAIL_MAX_SPANS_PER_SEC"];

/// The tail sampling settings (only read when `TRACETAP_TAIL_ENABLED=true`).
fn parse_tail(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<TailConfig, ConfigError> {
    let state_dir = src.or_default("TRACETAP_STATE_DIR").trim().into();
    // 5 times the longest gap measured between two fragments of one trace (docs/PERFORMANCE.md).
    let grace = src.duration("TRACETAP_TAIL_GRACE")?;
    let decision_wait = src.duration("TRACETAP_TAIL_DECISION_WAIT")?;
    if decision_wait < grace {
        return Err(err(
            "TRACETAP_TAIL_DECISION_WAIT",
            &format!("{decision_wait:?}"),
            format!("at least TRACETAP_TAIL_GRACE ({grace:?})"),
        ));
    }
    let max_disk_bytes: u64 = src.parse("TRACETAP_TAIL_MAX_DISK_BYTES", "a whole number of bytes")?;
    if max_disk_bytes < 1 << 20 {
        return Err(err("TRACETAP_TAIL_MAX_DISK_BYTES", &max_disk_bytes.to_string(), "at least 1048576 bytes"));
    }
    let spill_after = src.duration("TRACETAP_TAIL_SPILL_AFTER")?;
    let max_memory_bytes: u64 =
        src.parse("TRACETAP_TAIL_MAX_MEMORY_BYTES", "a whole number of bytes (0: every trace waits in the store)")?;
    let journal = match src.or_default("TRACETAP_TAIL_JOURNAL").trim() {
        "sync" => Some(Sync::Data),
        "nosync" => Some(Sync::None),
        "off" => None,
        other => return Err(err("TRACETAP_TAIL_JOURNAL", other, "`sync`, `nosync` or `off`")),
    };
    let decision_cache: usize = src.parse("TRACETAP_TAIL_DECISION_CACHE", "a positive whole number")?;
    if decision_cache == 0 {
        return Err(err("TRACETAP_TAIL_DECISION_CACHE", "0", "a positive whole number"));
    }
    let policies = if let Some(file) = src.get("TRACETAP_TAIL_POLICY_FILE") {
        if let Some(var) = ENV_POLICY_VARS.iter().find(|v| src.get(v).is_some()) {
            return Err(err(
                "TRACETAP_TAIL_POLICY_FILE",
                &file,
                format!("either a policy file or the policy variables, not both ({var} is set too)"),
            ));
        }
        PolicySource::File(file.trim().into())
    } else {
        PolicySource::Env(env_policies(src)?)
    };
    Ok(TailConfig {
        state_dir,
        grace,
        decision_wait,
        spill_after,
        max_memory_bytes,
        max_disk_bytes,
        journal,
        decision_cache,
        policies,
    })
}

fn env_policies(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<Vec<NamedPolicy>, ConfigError> {
    let mut policies = Vec::new();
    let mut add = |name: &str, policy| policies.push(NamedPolicy { name: name.to_owned(), policy });
    if src.flag("TRACETAP_TAIL_KEEP_ERRORS")? {
        add("keep_errors", Policy::StatusCode { codes: vec![StatusCode::Error] });
    }
    if let Some(threshold_ms) = src.optional("TRACETAP_TAIL_LATENCY_MS", "a whole number of milliseconds")? {
        add("latency", Policy::Latency { threshold_ms, upper_threshold_ms: None });
    }
    let ratio: f64 = src.parse("TRACETAP_TAIL_RATIO", "a ratio from 0.0 to 1.0")?;
    if !(0.0..=1.0).contains(&ratio) {
        return Err(err("TRACETAP_TAIL_RATIO", &ratio.to_string(), "a ratio from 0.0 to 1.0"));
    }
    if ratio > 0.0 {
        add("probabilistic", Policy::Probabilistic { threshold: threshold_for(ratio) });
    }
    if let Some(rate) = src.optional::<u64>("TRACETAP_TAIL_MAX_SPANS_PER_SEC", "a positive whole number")? {
        if rate == 0 {
            return Err(err("TRACETAP_TAIL_MAX_SPANS_PER_SEC", "0", "a positive whole number"));
        }
        add("rate_limiting", Policy::RateLimiting { spans_per_second: rate });
    }
    if policies.is_empty() {
        return Err(err(
            "TRACETAP_TAIL_KEEP_ERRORS",
            "false",
            "some tail policy: with errors not kept, set TRACETAP_TAIL_LATENCY_MS, TRACETAP_TAIL_RATIO, TRACETAP_TAIL_MAX_SPANS_PER_SEC or TRACETAP_TAIL_POLICY_FILE",
        ));
    }
    Ok(policies)
}

impl Config {
    /// The resource attributes of everything the agent exports.
    #[must_use]
    pub fn resource(&self) -> Vec<(String, String)> {
        crate::resource::attributes(&self.service_name, &self.resource_attributes, self.node_name.as_deref())
    }

    /// Parses the process environment.
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parses a map of variables (tests).
    pub fn from_map(map: &BTreeMap<String, String>) -> Result<Self, ConfigErrors> {
        Self::from_lookup(|k| map.get(k).cloned())
    }

    /// Every variable is read, and each bad one reported, not only the first: the settings of the
    /// agent one by one, and the export, metrics, sampler and tail settings each with their first.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigErrors> {
        let src = Source { get };

        let export = settings::parse(Signal::Traces, &|var| (src.get)(var));
        let telemetry = telemetry::parse(&|var| (src.get)(var));
        let service_name = src.or_default("OTEL_SERVICE_NAME").trim().to_owned();
        let resource_attributes = match src.get("OTEL_RESOURCE_ATTRIBUTES") {
            Some(v) => settings::parse_pairs("OTEL_RESOURCE_ATTRIBUTES", &v),
            None => Ok(Vec::new()),
        };
        let sampler = Sampler::from_vars(
            src.get("OTEL_TRACES_SAMPLER").as_deref(),
            src.get("OTEL_TRACES_SAMPLER_ARG").as_deref(),
        );

        let schedule_delay = src.millis("OTEL_BSP_SCHEDULE_DELAY");
        let (max_queue_size, max_export_batch_size) = parse_batch_sizes(&src);

        let admin_addr: Result<SocketAddr, _> = src.parse("TRACETAP_ADMIN_ADDR", "an address like 127.0.0.1:9464");
        let capture_bytes = parse_capture_bytes(&src);
        let targets = parse_targets(&src);
        let ring_bytes = parse_ring_bytes(&src);
        let probe_stats = src.flag("TRACETAP_PROBE_STATS");
        let probe_mode = parse_probe_mode(&src);
        let tls_probes = parse_tls_probes(&src);
        let tls_route = parse_tls_route(&src);
        let log_filter = src.or_default("TRACETAP_LOG");
        let tail = src.flag("TRACETAP_TAIL_ENABLED").and_then(|on| on.then(|| parse_tail(&src)).transpose());
        let pod_selector = parse_pod_selector(&src);
        let attribute_value_length_limit = parse_value_length_limit(&src);
        let exchange_idle_timeout = parse_exchange_idle_timeout(&src);
        let runtime_api = src.flag("TRACETAP_HAPROXY_RUNTIME_API");
        let rejected_spans_per_second: Result<u32, _> =
            src.parse("TRACETAP_REJECTED_SPANS_PER_SECOND", "a whole number of spans a second");

        let errors: Vec<ConfigError> = [
            export.as_ref().err(),
            telemetry.as_ref().err(),
            resource_attributes.as_ref().err(),
            sampler.as_ref().err(),
            schedule_delay.as_ref().err(),
            max_queue_size.as_ref().err(),
            max_export_batch_size.as_ref().err(),
            admin_addr.as_ref().err(),
            capture_bytes.as_ref().err(),
            targets.as_ref().err(),
            ring_bytes.as_ref().err(),
            probe_stats.as_ref().err(),
            probe_mode.as_ref().err(),
            tls_probes.as_ref().err(),
            tls_route.as_ref().err(),
            tail.as_ref().err(),
            pod_selector.as_ref().err(),
            attribute_value_length_limit.as_ref().err(),
            exchange_idle_timeout.as_ref().err(),
            runtime_api.as_ref().err(),
            rejected_spans_per_second.as_ref().err(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        if !errors.is_empty() {
            return Err(ConfigErrors::new(errors));
        }
        // No error is left: each `?` below passes its value through.
        Ok(Self {
            export: export?,
            telemetry: telemetry?,
            service_name,
            resource_attributes: resource_attributes?,
            sampler: sampler?,
            schedule_delay: schedule_delay?,
            max_queue_size: max_queue_size?,
            max_export_batch_size: max_export_batch_size?,
            admin_addr: admin_addr?,
            capture_bytes: capture_bytes?,
            targets: targets?,
            ring_bytes: ring_bytes?,
            probe_stats: probe_stats?,
            probe_mode: probe_mode?,
            tls_probes: tls_probes?,
            tls_route: tls_route?,
            log_filter,
            tail: tail?,
            node_name: src.get("NODE_NAME").map(|n| n.trim().to_owned()),
            pod_selector: pod_selector?,
            attribute_value_length_limit: attribute_value_length_limit?,
            exchange_idle_timeout: exchange_idle_timeout?,
            runtime_api: runtime_api?,
            rejected_spans_per_second: rejected_spans_per_second?,
        })
    }
}

/// `OTEL_BSP_MAX_QUEUE_SIZE` and `OTEL_BSP_MAX_EXPORT_BATCH_SIZE`, each with its own error: the
/// batch size is checked against the queue size only when that one is good.
fn parse_batch_sizes(
    src: &Source<impl Fn(&str) -> Option<String>>,
) -> (Result<usize, ConfigError>, Result<usize, ConfigError>) {
    let positive = "a positive whole number";
    let max_queue_size: Result<usize, _> = src
        .parse("OTEL_BSP_MAX_QUEUE_SIZE", positive)
        .and_then(|n| if n == 0 { Err(err("OTEL_BSP_MAX_QUEUE_SIZE", "0", positive)) } else { Ok(n) });
    let max_export_batch_size = src.parse("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", positive).and_then(|n: usize| {
        let queue = max_queue_size.as_ref().copied().unwrap_or(usize::MAX);
        if n == 0 || n > queue {
            let bound = max_queue_size.as_ref().map_or_else(|_| String::new(), |q| format!(" ({q})"));
            Err(err(
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
                &n.to_string(),
                format!("a positive whole number no larger than OTEL_BSP_MAX_QUEUE_SIZE{bound}"),
            ))
        } else {
            Ok(n)
        }
    });
    (max_queue_size, max_export_batch_size)
}

fn parse_capture_bytes(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<u32, ConfigError> {
    let capture_bytes: u32 = src.parse("TRACETAP_CAPTURE_BYTES", "a whole number of bytes")?;
    if !(MIN_CAPTURE_BYTES..=MAX_CAPTURE_BYTES).contains(&capture_bytes) {
        return Err(err(
            "TRACETAP_CAPTURE_BYTES",
            &capture_bytes.to_string(),
            format!("a whole number of bytes from {MIN_CAPTURE_BYTES} to {MAX_CAPTURE_BYTES}"),
        ));
    }
    Ok(capture_bytes)
}

fn parse_ring_bytes(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<u32, ConfigError> {
    let expected = "a power of two of at least 65536 bytes";
    let ring_bytes: u32 = src.parse("TRACETAP_RING_BYTES", expected)?;
    if !ring_bytes.is_power_of_two() || ring_bytes < 65536 {
        return Err(err("TRACETAP_RING_BYTES", &ring_bytes.to_string(), expected));
    }
    Ok(ring_bytes)
}

fn parse_probe_mode(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<ProbeMode, ConfigError> {
    match src.or_default("TRACETAP_PROBE_MODE").trim() {
        "capture" => Ok(ProbeMode::Capture),
        "floor" => Ok(ProbeMode::Floor),
        v => Err(err("TRACETAP_PROBE_MODE", v, "capture or floor")),
    }
}

fn parse_tls_probes(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<TlsProbes, ConfigError> {
    match src.or_default("TRACETAP_TLS_PROBES").trim() {
        "auto" => Ok(TlsProbes::Auto),
        "entry" => Ok(TlsProbes::Entry),
        "off" => Ok(TlsProbes::Off),
        v => Err(err("TRACETAP_TLS_PROBES", v, "auto, entry or off")),
    }
}

fn parse_tls_route(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<TlsRoute, ConfigError> {
    match src.or_default("TRACETAP_TLS_ROUTE").trim() {
        "auto" => Ok(TlsRoute::Auto),
        "uprobe_multi" => Ok(TlsRoute::UprobeMulti),
        "perf" => Ok(TlsRoute::Perf),
        "tracefs" => Ok(TlsRoute::Tracefs),
        v => Err(err("TRACETAP_TLS_ROUTE", v, "auto, uprobe_multi, perf or tracefs")),
    }
}

fn parse_targets(src: &Source<impl Fn(&str) -> Option<String>>) -> Result<Targets, ConfigError> {
    if let Some(pids) = src.get("TRACETAP_TARGET_PIDS") {
        return Ok(Targets::Pids(parse_pids(&pids)?));
    }
    let comm = src.or_default("TRACETAP_TARGET_COMM").trim().to_owned();
    if comm.len() >= COMM_BYTES || comm.contains('\0') {
        return Err(err("TRACETAP_TARGET_COMM", &comm, "a command name of 1 to 15 bytes (as in /proc/PID/comm)"));
    }
    Ok(Targets::Comm(comm))
}

fn parse_pids(text: &str) -> Result<Vec<u32>, ConfigError> {
    let pids: Result<Vec<u32>, _> = text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::parse).collect();
    match pids {
        Ok(p) if !p.is_empty() && !p.contains(&0) => Ok(p),
        _ => Err(err("TRACETAP_TARGET_PIDS", text, "comma-separated process ids, e.g. 1234,5678")),
    }
}

#[cfg(test)]
mod tests;
