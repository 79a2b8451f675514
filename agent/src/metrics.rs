//! The agent's counters, shared between the capture thread, the exporter and the admin endpoint,
//! rendered as Prometheus text. Every way a request or span can be lost has a counter here.
//!
//! The text is written here, not by a crate, on purpose: `prometheus-client` writes label values
//! as given, unescaped (`prometheus/client_rust#151`, open), and a tail policy's name comes from the
//! operator's file; OpenTelemetry's Prometheus exporter is discontinued (its last release says
//! so). The format is small: `# HELP`, `# TYPE`, then `name value` or `name{labels} value`, label
//! values escaped by [`escape_label_value`] (tested with a line feed, a quote and a backslash).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// What a metric is: a counter only grows; a gauge is overwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

impl MetricKind {
    /// Its name in the Prometheus text format's `# TYPE` line.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
        }
    }
}

/// One counter or gauge: its Prometheus name, its kind, its help text, and how to read it.
#[derive(Debug, Clone, Copy)]
pub struct Descriptor {
    pub name: &'static str,
    pub kind: MetricKind,
    pub help: &'static str,
    pub read: fn(&Metrics) -> u64,
}

impl Metrics {
    /// Counts a failed TLS handshake of a span export, by its cause's label.
    pub fn count_export_tls_failure(&self, reason: &'static str) {
        if let Ok(mut failures) = self.export_tls_failures.lock() {
            *failures.entry(reason).or_default() += 1;
        }
    }

    /// Records why span exports fail (`Some`), or that they work again (`None`).
    pub fn set_export_failing(&self, why: Option<String>) {
        if let Ok(mut failing) = self.export_failing.lock() {
            *failing = why;
        }
    }

    /// Tail decisions by deciding policy and outcome so far.
    #[must_use]
    pub fn tail_decisions(&self) -> Vec<(DecisionKey, u64)> {
        self.tail_decisions.lock().map(|d| d.iter().map(|(k, v)| (k.clone(), *v)).collect()).unwrap_or_default()
    }
}

/// What a tail decision is counted under: the policy that decided it (`None`: no policy matched,
/// labelled `none`) and whether the trace was kept.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DecisionKey {
    pub policy: Option<String>,
    pub kept: bool,
}

impl DecisionKey {
    #[must_use]
    pub fn policy_label(&self) -> &str {
        self.policy.as_deref().unwrap_or("none")
    }

    #[must_use]
    pub fn outcome_label(&self) -> &'static str {
        if self.kept { "kept" } else { "dropped" }
    }
}

macro_rules! metrics {
    ($( $field:ident : $kind:ident, $name:literal, $help:literal; )*) => {
        /// All counters and gauges. Counters only grow; gauges are overwritten.
        #[derive(Debug, Default)]
        pub struct Metrics {
            $( pub $field: AtomicU64, )*
            /// Probes are attached, at least one target process is traced and its configuration
            /// names are loaded (or known unreadable).
            pub ready: AtomicBool,
            /// How the TLS probes attach, or why they cannot (one line, shown by `/readyz`).
            pub tls_route: std::sync::OnceLock<String>,
            /// Tail decisions by (policy, outcome); the policy is `none` when no policy matched.
            pub tail_decisions: Mutex<BTreeMap<DecisionKey, u64>>,
            /// Failed TLS handshakes of span exports, by cause (`export::tls_failure`'s labels).
            pub export_tls_failures: Mutex<BTreeMap<&'static str, u64>>,
            /// Why the last span export failed; `None` once one succeeds (shown by `/readyz`).
            pub export_failing: Mutex<Option<String>>,
        }

        /// Every plain counter and gauge, for exporters other than the Prometheus text (the
        /// agent's own telemetry over OTLP).
        pub const DESCRIPTORS: &[Descriptor] = &[
            $( Descriptor { name: $name, kind: MetricKind::$kind, help: $help, read: |m: &Metrics| m.$field.load(Relaxed) }, )*
            Descriptor {
                name: "tracetap_ready",
                kind: MetricKind::Gauge,
                help: "1 once probes are attached to at least one target",
                read: |m: &Metrics| u64::from(m.ready.load(Relaxed)),
            },
        ];

        impl Metrics {
            /// Prometheus text exposition format, version 0.0.4.
            #[must_use]
            pub fn render(&self) -> String {
                let mut out = String::with_capacity(4096);
                $(
                    let _ = writeln!(out, "# HELP {} {}", $name, $help);
                    let _ = writeln!(out, "# TYPE {} {}", $name, MetricKind::$kind.as_str());
                    let _ = writeln!(out, "{} {}", $name, self.$field.load(Relaxed));
                )*
                let _ = writeln!(out, "# HELP tracetap_ready 1 once probes are attached to at least one target");
                let _ = writeln!(out, "# TYPE tracetap_ready gauge");
                let _ = writeln!(out, "tracetap_ready {}", u8::from(self.ready.load(Relaxed)));
                let _ = writeln!(out, "# HELP tracetap_tail_decisions_total Tail sampling decisions by deciding policy and outcome");
                let _ = writeln!(out, "# TYPE tracetap_tail_decisions_total counter");
                let _ = writeln!(out, "# HELP tracetap_export_tls_failures_total Span exports whose TLS handshake failed, by cause (the log and /readyz say what to change); retried, the spans held");
                let _ = writeln!(out, "# TYPE tracetap_export_tls_failures_total counter");
                if let Ok(failures) = self.export_tls_failures.lock() {
                    for (reason, n) in failures.iter() {
                        let _ = writeln!(out, "tracetap_export_tls_failures_total{{reason=\"{reason}\"}} {n}");
                    }
                }
                if let Ok(decisions) = self.tail_decisions.lock() {
                    for (key, n) in decisions.iter() {
                        let (policy, outcome) = (escape_label_value(key.policy_label()), key.outcome_label());
                        let _ = writeln!(out, "tracetap_tail_decisions_total{{policy=\"{policy}\",outcome=\"{outcome}\"}} {n}");
                    }
                }
                out
            }
        }
    };
}

metrics! {
    events_captured: Counter, "tracetap_events_captured_total", "Syscall events read from the ring buffer";
    events_lost_ring_full: Counter, "tracetap_events_lost_ring_full_total", "Events the probes could not reserve in the ring buffer";
    events_lost_read_failed: Counter, "tracetap_events_lost_read_failed_total", "Payload or address copies from user memory that failed";
    events_lost_tls_unbound: Counter, "tracetap_events_lost_tls_unbound_total", "TLS plaintext the probes could not tie to a connection they numbered (opened before the agent started, or closed since); not traced";
    tls_processes: Gauge, "tracetap_tls_processes", "Traced processes with the TLS library probes attached";
    tls_links_detaching: Gauge, "tracetap_tls_links_detaching", "TLS probe links of ended or untraced processes waiting to be detached (each waits for the kernel's grace periods, on a thread of its own)";
    tls_hook_failures: Counter, "tracetap_tls_hook_failures_total", "Traced processes mapping a TLS library to which the TLS probes could not be attached (their TLS traffic is not traced; the log says why)";
    h2_connections: Counter, "tracetap_h2_connections_total", "Connections that began with the HTTP/2 preface (cleartext or in TLS), decoded per stream";
    h2_streams: Counter, "tracetap_h2_streams_total", "HTTP/2 request heads seen (each also counts as a frontend or backend request)";
    h2_resets: Counter, "tracetap_h2_resets_total", "HTTP/2 RST_STREAM frames seen, either direction (the stream's span ends with error.type http2.rst_stream.CODE)";
    h2_goaways: Counter, "tracetap_h2_goaways_total", "HTTP/2 GOAWAY frames seen, either direction";
    h2_desyncs: Counter, "tracetap_h2_desyncs_total", "HTTP/2 connections whose header compression state was lost (bytes missing from a frame header or header block, a decoding error, a capture gap): their open streams end with error.type tracetap.capture_gap and the rest of the connection is not decoded";
    events_malformed: Counter, "tracetap_events_malformed_total", "Ring buffer records the agent could not decode";
    parse_errors: Counter, "tracetap_parse_errors_total", "HTTP/1 heads or bodies that could not be parsed";
    opaque_connections: Counter, "tracetap_opaque_connections_total", "Connections ignored because they do not speak HTTP/1";
    opaque_marks: Counter, "tracetap_opaque_marks_total", "Marks written to the probes for opaque connections (TLS, mode tcp, tunnels): from then on their bytes are not copied";
    opaque_marks_refused: Counter, "tracetap_opaque_marks_refused_total", "Opaque connections the probes could not be told about (mark table full, or the write failed): their bytes are still copied, and ignored";
    payload_bytes_captured: Counter, "tracetap_payload_bytes_captured_total", "Payload bytes the probes copied into the ring buffer";
    unknown_descriptors: Counter, "tracetap_unknown_descriptors_total", "Descriptors never seen opened whose first bytes are not HTTP/1 (files HAProxy reads, its wake-up pipes, sockets older than the agent); ignored until closed";
    unpaired_responses: Counter, "tracetap_unpaired_responses_total", "Responses with no parsed request (HAProxy answering by itself to a bad or missing request)";
    requests_seen: Counter, "tracetap_requests_total", "Frontend requests seen (one SERVER span each when sampled)";
    backend_requests_seen: Counter, "tracetap_backend_requests_total", "Backend requests seen";
    backend_unlinked: Counter, "tracetap_backend_requests_unlinked_total", "Backend requests not tied to any frontend request (health checks, or links missed); not exported";
    backend_late: Counter, "tracetap_backend_exchanges_late_total", "Backend exchanges that ended after their SERVER span was exported; not exported";
    truncated_heads: Counter, "tracetap_request_heads_truncated_total", "Request heads longer than TRACETAP_CAPTURE_BYTES: traced from their first lines, headers past the window unseen";
    exchanges_expired: Counter, "tracetap_exchanges_expired_total", "Exchanges given up after TRACETAP_EXCHANGE_IDLE_TIMEOUT without activity";
    capture_gaps: Counter, "tracetap_capture_gaps_total", "Connections on which a record was lost (ring buffer full); their open exchanges end with error.type tracetap.capture_gap";
    gap_exchanges: Counter, "tracetap_capture_gap_exchanges_total", "Exchanges ended early because their connection lost a record";
    unnumbered_connections: Counter, "tracetap_connections_unnumbered_total", "Connections whose records stopped being numbered (more than 65536 connections numbered at once): their gaps can no longer be seen";
    backend_relinked: Counter, "tracetap_backend_exchanges_relinked_total", "Backend exchanges moved to another frontend request when HAProxy relayed their response (it wrote requests out of order)";
    backend_quarantined: Counter, "tracetap_backend_exchanges_quarantined_total", "Backend exchanges not exported because records were lost while their link was open to doubt (within 1 s of a loss, or linked with rivals or by headers before it); their SERVER spans are exported";
    sampled_in: Counter, "tracetap_requests_sampled_total", "Requests the head sampler kept";
    sampled_out: Counter, "tracetap_requests_sampled_out_total", "Requests dropped by the head sampler";
    sampled_out_at_head: Counter, "tracetap_requests_sampled_out_at_head_total", "Of the requests dropped by the head sampler, those dropped by their own valid traceparent as their head was read: only paired with their response, never an exchange (also in tracetap_requests_sampled_out_total)";
    sampled_out_in_probe: Counter, "tracetap_requests_sampled_out_in_probe_total", "Of the requests dropped at their head, those the probes dropped: one whole request head without a body read at once, whose bytes were not copied to the agent (also in tracetap_requests_sampled_out_at_head_total)";
    backend_sampled_out_at_head: Counter, "tracetap_backend_requests_sampled_out_at_head_total", "Backend requests carrying the trace of a request dropped at its head whose own traceparent drops them too: only paired with their response, never linked (also in tracetap_backend_requests_total)";
    rejected_spans_dropped: Counter, "tracetap_rejected_request_spans_dropped_total", "SERVER spans of requests HAProxy rejected as malformed that TRACETAP_REJECTED_SPANS_PER_SECOND left out";
    propagated: Counter, "tracetap_requests_propagated_total", "Requests handed out whose trace context HAProxy forwarded itself (tracetap haproxy-snippet); their CLIENT spans take the forwarded parent ids. Requests dropped at their head are not handed out (tracetap_backend_requests_sampled_out_at_head_total counts their backend requests)";
    server_names_ambiguous: Counter, "tracetap_server_names_ambiguous_total", "CLIENT spans left without haproxy.backend and haproxy.server: several server lines share the address and the frontend's routes (default_backend, use_backend) do not single one out";
    sampling_disagreements: Counter, "tracetap_sampling_disagreements_total", "Propagated requests whose forwarded sampled flag differs from OTEL_TRACES_SAMPLER's decision (HAProxy's flag is followed), and backend requests forwarded as sampled for a request whose own traceparent the sampler dropped at its head (left out)";
    spans_built: Counter, "tracetap_spans_built_total", "Spans built";
    spans_exported: Counter, "tracetap_spans_exported_total", "Spans accepted by the exporter's destination";
    spans_dropped_queue_full: Counter, "tracetap_spans_dropped_queue_full_total", "Spans dropped because the export queue was full";
    spans_dropped_export_failed: Counter, "tracetap_spans_dropped_export_failed_total", "Spans dropped after their export failed for good";
    spans_rejected: Counter, "tracetap_spans_rejected_total", "Spans the collector accepted the request of but rejected (OTLP partial success; the log gives its message)";
    export_retries: Counter, "tracetap_export_retries_total", "Export requests retried";
    export_failures: Counter, "tracetap_export_failures_total", "Export requests that failed for good";
    metrics_export_failures: Counter, "tracetap_metrics_export_failures_total", "Exports of the agent's own metrics over OTLP that failed (the log says why, at most every 10 s)";
    admin_accept_errors: Counter, "tracetap_admin_accept_errors_total", "Failed accepts on the admin endpoint (retried with backoff, 10 ms doubling to 1 s)";
    probe_runs: Counter, "tracetap_probe_runs_total", "Probe runs in the kernel (needs TRACETAP_PROBE_STATS=true)";
    probe_run_time_ns: Counter, "tracetap_probe_run_time_ns_total", "Time the probes ran in the kernel, in ns (needs TRACETAP_PROBE_STATS=true)";
    tail_shed_traces: Counter, "tracetap_tail_shed_traces_total", "Traces shed before the tail store because it fell behind (by trace randomness, like a lower ratio)";
    tail_late_spans_kept: Counter, "tracetap_tail_late_spans_kept_total", "Spans that arrived after their trace was kept; exported";
    tail_late_spans_dropped: Counter, "tracetap_tail_late_spans_dropped_total", "Spans that arrived after their trace was dropped; not exported";
    tail_early_decisions: Counter, "tracetap_tail_early_decisions_total", "Traces decided before their time because the buffer reached TRACETAP_TAIL_MAX_DISK_BYTES";
    tail_store_errors: Counter, "tracetap_tail_store_errors_total", "Tail store operations that failed";
    tail_store_quarantined: Counter, "tracetap_tail_store_quarantined_total", "Tail stores that could not be opened or read (another format, a record that does not decode) and were set aside in TRACETAP_STATE_DIR/quarantine for a fresh one; what they held is lost";
    tail_spans_lost: Counter, "tracetap_tail_spans_lost_total", "Spans lost because the tail store failed to take them";
    tail_traces_pending: Gauge, "tracetap_tail_traces_pending", "Traces waiting for a tail decision";
    tail_outbox_traces: Gauge, "tracetap_tail_outbox_traces", "Kept traces whose export is not yet reported done (exported again after a crash)";
    tail_traces_in_memory: Gauge, "tracetap_tail_traces_in_memory", "Traces waiting for a tail decision in memory (never written to the store unless they spill)";
    tail_memory_bytes: Gauge, "tracetap_tail_memory_bytes", "Bytes of spans of traces waiting in memory (what TRACETAP_TAIL_MAX_MEMORY_BYTES bounds)";
    tail_decided_in_memory: Counter, "tracetap_tail_traces_decided_in_memory_total", "Traces decided from memory, never written to the tail store";
    tail_spilled_traces: Counter, "tracetap_tail_traces_spilled_total", "Traces written to the tail store to wait: undecided TRACETAP_TAIL_SPILL_AFTER after their first span, or the oldest while memory was over TRACETAP_TAIL_MAX_MEMORY_BYTES";
    tail_fragments_joined: Counter, "tracetap_tail_fragments_joined_total", "Fragments of a trace (its spans from a later batch: another process, exchange or CPU) that joined the trace while it waited in memory";
    tail_fragment_gap_max_ms: Gauge, "tracetap_tail_fragment_gap_max_ms", "Longest time seen between the arrival of a trace's first fragment and a later one that joined it, in ms (TRACETAP_TAIL_GRACE must cover it; later ones are late spans)";
    tail_resent_traces: Counter, "tracetap_tail_resent_traces_total", "Kept traces exported again after a restart because the journal had no report of their export (at least once: some had been exported just before a crash)";
    tail_journal_bytes: Gauge, "tracetap_tail_journal_bytes", "Bytes of the tail journal's segments on disk (counted against TRACETAP_TAIL_MAX_DISK_BYTES with the store's spans)";
    tail_journal_write_errors: Counter, "tracetap_tail_journal_write_errors_total", "Group commits or segments the tail journal failed to write (their traces are still decided from memory; a crash would lose them)";
    tail_journal_quarantined: Counter, "tracetap_tail_journal_quarantined_total", "Tail journal segments that did not read back at a start (a checksum or a record that failed) and were set aside in TRACETAP_STATE_DIR/journal/quarantine; what came before the damage was taken back";
    tail_journal_dropped_traces: Counter, "tracetap_tail_journal_dropped_traces_total", "Traces whose journal segment was removed to stay within TRACETAP_TAIL_MAX_DISK_BYTES before they were done with (still decided from memory; a crash would lose them)";
    tail_spans_buffered: Gauge, "tracetap_tail_spans_buffered", "Spans of traces waiting for a tail decision";
    tail_buffered_bytes: Gauge, "tracetap_tail_buffered_bytes", "Bytes of spans held in live partitions of the tail store (what TRACETAP_TAIL_MAX_DISK_BYTES bounds)";
    tail_disk_bytes: Gauge, "tracetap_tail_disk_bytes", "Bytes the tail store occupies on disk (sled's own figure, space amplification included)";
    server_names_waiting: Gauge, "tracetap_server_names_waiting", "Kept exchanges whose spans wait for the next runtime API table read, so that they report the server names true when their request was sent";
    server_names_unsettled: Counter, "tracetap_server_names_unsettled_total", "Kept exchanges that waited the longest (3 s) for a runtime API table read and were named with the newest table then";
    runtime_api_reads: Counter, "tracetap_haproxy_runtime_api_reads_total", "Server tables read from HAProxy's runtime API (show servers state on its stats socket)";
    runtime_api_errors: Counter, "tracetap_haproxy_runtime_api_errors_total", "Runtime API reads that failed (socket missing, permission denied, refused, no answer in time, not a server table); server names then come from the configuration file, and the first failure per process is logged with what to change";
    config_read_errors: Counter, "tracetap_config_read_errors_total", "HAProxy configuration files (or command lines) that could not be read: missing, not a regular file, over the size caps, or no answer in time; the spans they would name carry addresses";
    k8s_api_errors: Counter, "tracetap_k8s_api_errors_total", "Failed requests of the pod watch (retried with backoff)";
    k8s_api_up: Gauge, "tracetap_k8s_api_up", "1 while the pod watch is in sync with the API server";
    k8s_pods: Gauge, "tracetap_k8s_pods", "Pods of this node known from the API server";
    k8s_targets_not_selected: Gauge, "tracetap_k8s_targets_not_selected", "HAProxy processes left untraced because their pod does not match TRACETAP_K8S_POD_SELECTOR (or is not known yet)";
    targets: Gauge, "tracetap_targets", "Processes currently traced";
    connections: Gauge, "tracetap_connections", "Connections currently tracked";
    open_exchanges: Gauge, "tracetap_open_exchanges", "Frontend exchanges currently open";
}

/// Adds to a counter.
pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Relaxed);
}

/// A label value as the Prometheus text format writes it: backslash, double quote and line feed
/// escaped (a tail policy's name comes from the operator's file and may hold any of them).
fn escape_label_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Sets a gauge (or a counter mirrored from a source that already counts).
pub fn set(gauge: &AtomicU64, value: u64) {
    gauge.store(value, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_metric_with_help_and_type() {
        let m = Metrics::default();
        add(&m.spans_built, 3);
        let text = m.render();
        assert!(text.contains("tracetap_spans_built_total 3\n"));
        assert!(text.contains("# TYPE tracetap_targets gauge"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.split_once(' ').unwrap();
            assert!(name.starts_with("tracetap_"));
            value.parse::<u64>().unwrap();
        }
    }

    #[test]
    fn a_policy_name_with_a_line_feed_stays_on_its_line() {
        let m = Metrics::default();
        m.tail_decisions
            .lock()
            .unwrap()
            .insert(DecisionKey { policy: Some("slow\nfake_metric 1 \"\\".to_owned()), kept: true }, 2);
        let text = m.render();
        let lines: Vec<_> = text.lines().filter(|l| l.starts_with("tracetap_tail_decisions_total")).collect();
        assert_eq!(lines, [r#"tracetap_tail_decisions_total{policy="slow\nfake_metric 1 \"\\",outcome="kept"} 2"#]);
        assert!(!text.lines().any(|l| l.starts_with("fake_metric")));
    }
}
