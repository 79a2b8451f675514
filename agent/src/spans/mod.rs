//! From finished exchanges to spans: trace context, the head sampling decision, and the
//! attributes of the stable HTTP semantic conventions.
//!
//! Two steps, so a dropped request costs nothing: [`SpanBuilder::decide`] takes the sampling
//! decision from the request head alone (no span, no attribute, no allocation when it drops), and
//! [`SpanBuilder::views`] writes the spans of a kept exchange into a `bumpalo` arena as
//! [`SpanView`]s that borrow the exchange's captured strings; `encode::BatchEncoder` turns them into
//! OTLP bytes. [`SpanBuilder::build`] makes prost messages from the same views: the reference path,
//! kept for tests and benchmarks.
//!
//! Privacy and limits: `url.query` and `url.full` come through [`crate::target`], which redacts
//! credentials; string values are cut to `OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT` characters.
//! Both borrow when there is nothing to change.

use std::net::SocketAddr;

use bumpalo::Bump;
use bumpalo::collections::{String as BumpString, Vec as BumpVec};
use opentelemetry_proto::tonic::trace::v1::{Span, span};
use tracetap_proxy::haproxy_config::{ProxyNames, ServerMatch};
use tracetap_proxy::termination::termination_state;
use tracetap_proxy::trace_context::{FLAG_RANDOM, TraceParent};
use tracetap_proxy::{ClientExchange, Outcome, RequestHead, ServerExchange, TlsInfo};

use crate::encode::{Attr, SpanView, Value};
use crate::rate_limit::RateLimit;
use crate::sampling::Sampler;
use crate::target::{Target, push_ip, scrub_query, scrub_request_line, truncate_chars};
use crate::timeline;

/// Span flags: the W3C sampled flag, plus "has `is_remote`" (bit 8) and "`is_remote`" (bit 9) of the
/// OTLP `SpanFlags` for the parent.
const SAMPLED: u32 = 0x01;
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

/// `TRACETAP_REJECTED_SPANS_PER_SECOND`'s default.
pub const DEFAULT_REJECTED_SPANS_PER_SECOND: u32 = 10;

/// The attribute with the escaped start of a request `HAProxy` rejected as malformed.
pub const REJECTED_PREFIX: &str = "tracetap.request.rejected_prefix";

/// A span and the traced process it belongs to (one OTLP resource per process).
#[derive(Debug, Clone)]
pub struct SpanRecord {
    pub tgid: u32,
    pub span: Span,
}

/// The trace context of a kept exchange.
#[derive(Debug, Clone)]
pub struct Decision {
    pub trace_id: [u8; 16],
    /// The incoming parent span id, all zero for a new trace.
    pub parent_span_id: [u8; 8],
    pub trace_state: String,
    pub flags: u32,
    /// `HAProxy` forwarded a trace context of its own (see [`propagated_context`]): each CLIENT
    /// span takes the parent id its request carried.
    pub propagated: bool,
}

/// What [`SpanBuilder::decide`] counted since the builder was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecideStats {
    /// Requests whose trace context `HAProxy` forwarded itself.
    pub propagated: u64,
    /// Of those, the ones whose forwarded sampled flag differs from what `OTEL_TRACES_SAMPLER`
    /// decides for the same trace id (`HAProxy`'s flag stands: the backend follows it).
    pub disagreements: u64,
    /// CLIENT spans left without backend and server names because several `server` lines share
    /// the address and the frontend's routes did not single one out.
    pub ambiguous_servers: u64,
    /// Requests `HAProxy` rejected as malformed whose span the rate limit left out (see
    /// [`SpanBuilder::admit`]).
    pub rejected_dropped: u64,
}

/// Builds spans. Owned by the capture thread.
#[derive(Debug)]
pub struct SpanBuilder {
    sampler: Sampler,
    rng: fastrand::Rng,
    /// Added to monotonic ns to get Unix ns.
    mono_to_unix_ns: i128,
    /// Most characters of a string attribute value (`OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT`).
    value_length_limit: Option<usize>,
    /// How many spans of rejected requests may be built (`TRACETAP_REJECTED_SPANS_PER_SECOND`).
    rejected_limit: RateLimit,
    stats: DecideStats,
}

/// What [`SpanBuilder::build`] did with an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Built {
    Sampled { spans: usize },
    Dropped,
}

impl SpanBuilder {
    #[must_use]
    pub fn new(sampler: Sampler, mono_to_unix_ns: i128) -> Self {
        Self {
            sampler,
            rng: fastrand::Rng::new(),
            mono_to_unix_ns,
            value_length_limit: None,
            rejected_limit: RateLimit::new(DEFAULT_REJECTED_SPANS_PER_SECOND),
            stats: DecideStats::default(),
        }
    }

    /// A builder with a fixed seed for its ids (tests and benchmarks).
    #[must_use]
    pub fn with_seed(sampler: Sampler, mono_to_unix_ns: i128, seed: u64) -> Self {
        Self {
            sampler,
            rng: fastrand::Rng::with_seed(seed),
            mono_to_unix_ns,
            value_length_limit: None,
            rejected_limit: RateLimit::new(DEFAULT_REJECTED_SPANS_PER_SECOND),
            stats: DecideStats::default(),
        }
    }

    /// Cuts string attribute values to `limit` characters (`None`: no limit, the default), as
    /// `Config::attribute_value_length_limit` says.
    #[must_use]
    pub fn with_value_length_limit(mut self, limit: Option<usize>) -> Self {
        self.value_length_limit = limit;
        self
    }

    /// Builds at most `per_second` spans a second for requests `HAProxy` rejected as malformed.
    #[must_use]
    pub fn with_rejected_limit(mut self, per_second: u32) -> Self {
        self.rejected_limit = RateLimit::new(per_second);
        self
    }

    /// Whether an exchange may become spans at all: a request `HAProxy` rejected as malformed
    /// only within the rate limit (a flood of garbage must not flood the exporter); what it
    /// leaves out is counted in [`DecideStats::rejected_dropped`]. Call it before
    /// [`SpanBuilder::decide`].
    pub fn admit(&mut self, ex: &ServerExchange) -> bool {
        if ex.rejected.is_none() || self.rejected_limit.admit(ex.end_ns) {
            return true;
        }
        self.stats.rejected_dropped += 1;
        false
    }

    fn unix_ns(&self, mono: u64) -> u64 {
        (i128::from(mono) + self.mono_to_unix_ns).max(0) as u64
    }

    /// What [`SpanBuilder::decide`] counted.
    #[must_use]
    pub fn stats(&self) -> DecideStats {
        self.stats
    }

    /// The head sampling decision for an exchange, from its request head (and, when `HAProxy`
    /// propagates, from the trace context it forwarded). `None`: drop it.
    pub fn decide(&mut self, ex: &ServerExchange) -> Option<Decision> {
        let incoming = ex.request.as_ref().and_then(|r| r.parsed_traceparent);
        let incoming_state = ex.request.as_ref().and_then(|r| r.tracestate.as_deref());
        if let Some(forwarded) = propagated_context(ex, incoming.as_ref()) {
            return self.follow(ex, incoming, incoming_state, forwarded);
        }
        let trace_id = incoming.map_or_else(|| new_trace_id(&mut self.rng), |p| p.trace_id);
        let trace_state = self.sampler.decide(incoming.as_ref(), incoming_state, &trace_id)?;
        Some(Decision {
            trace_id,
            parent_span_id: incoming.map_or([0; 8], |p| p.parent_id),
            trace_state,
            flags: server_flags(incoming.as_ref(), FLAG_RANDOM),
            propagated: false,
        })
    }

    /// The decision for a request `HAProxy` forwarded with a context of its own: its trace id, and
    /// its sampled flag, which the backend follows, so the trace is whole either way. The lines
    /// `tracetap haproxy-snippet` prints compute that flag by the same rule as the sampler; a
    /// difference (lines made for another sampler) is counted and logged once.
    fn follow(
        &mut self,
        ex: &ServerExchange,
        incoming: Option<TraceParent>,
        incoming_state: Option<&str>,
        forwarded: TraceParent,
    ) -> Option<Decision> {
        self.stats.propagated += 1;
        // The incoming parent is this trace's only when HAProxy kept its trace id.
        let parent = incoming.filter(|p| p.trace_id == forwarded.trace_id);
        let own =
            self.sampler.decide(parent.as_ref(), incoming_state.filter(|_| parent.is_some()), &forwarded.trace_id);
        if own.is_some() != forwarded.sampled() {
            if self.stats.disagreements == 0 {
                tracing::warn!(
                    "HAProxy forwarded a sampled flag that OTEL_TRACES_SAMPLER would not have set; HAProxy's flag is \
                     followed (the backend follows it too). Print the lines again with `tracetap haproxy-snippet` \
                     under this agent's sampler settings."
                );
            }
            self.stats.disagreements += 1;
        }
        if !forwarded.sampled() {
            return None;
        }
        // The spans carry the tracestate the sampler gives them, which is what the lines forward;
        // when the two disagree, what HAProxy forwarded.
        let trace_state =
            own.unwrap_or_else(|| ex.clients.iter().find_map(|c| c.request.tracestate.clone()).unwrap_or_default());
        Some(Decision {
            trace_id: forwarded.trace_id,
            parent_span_id: parent.map_or([0; 8], |p| p.parent_id),
            trace_state,
            flags: server_flags(parent.as_ref(), forwarded.flags & FLAG_RANDOM),
            propagated: true,
        })
    }

    /// The SERVER span of a kept exchange and a CLIENT span per backend exchange, in `bump`, named
    /// after HAProxy's frontend and backends when `names` knows them.
    pub fn views<'a>(
        &mut self,
        ex: &'a ServerExchange,
        decision: &'a Decision,
        names: Option<&'a ProxyNames>,
        bump: &'a Bump,
        out: &mut BumpVec<'a, SpanView<'a>>,
    ) {
        let span_id = new_span_id(&mut self.rng);
        let request = ex.request.as_ref();
        let method = request.map_or("_OTHER", |r| known_method(&r.method));
        let status_code = ex.response.map(|r| r.status);
        let mut attrs = BumpVec::with_capacity_in(16, bump);
        push_request_attributes(&mut attrs, bump, request.map(|r| (r, Target::parse(&r.target))), ex.tls);
        if let Some(r) = request {
            if let Some(host) = &r.host {
                let (address, port) = split_host(host);
                attrs.push(attr_str("server.address", address));
                if let Some(port) = port {
                    attrs.push(attr_int("server.port", i64::from(port)));
                }
            }
            if let Some(ua) = &r.user_agent {
                attrs.push(attr_str("user_agent.original", ua));
            }
        }
        // client.*: the original client, which a PROXY protocol header names when a load balancer
        // sits in front of HAProxy; network.peer.*: always the socket's peer.
        let peer_ip = ex.peer.map(|peer| ip_in(bump, peer));
        match (ex.client, ex.peer.zip(peer_ip)) {
            (Some(client), _) => {
                attrs.push(attr_str("client.address", ip_in(bump, client)));
                attrs.push(attr_int("client.port", i64::from(client.port())));
            }
            (None, Some((peer, ip))) => {
                attrs.push(attr_str("client.address", ip));
                attrs.push(attr_int("client.port", i64::from(peer.port())));
            }
            (None, None) => {}
        }
        if let Some((peer, ip)) = ex.peer.zip(peer_ip) {
            push_peer(&mut attrs, ip, peer.port());
        }
        if let Some(code) = status_code {
            attrs.push(attr_int("http.response.status_code", i64::from(code)));
        }
        let frontend = names.zip(ex.local).and_then(|(n, local)| n.frontend(local));
        if let Some(fe) = frontend {
            attrs.push(attr_str("haproxy.frontend", fe));
        }
        // SERVER spans: 5xx and aborted exchanges are errors, 4xx are the client's business,
        // except for a request HAProxy rejected as malformed, which is the error itself.
        if let Some(rejected) = &ex.rejected {
            attrs.push(attr_str(REJECTED_PREFIX, scrub_request_line(&rejected.prefix, bump)));
        }
        if let Some(state) = termination_state(ex) {
            attrs.push(attr_str("haproxy.termination_state", state));
        }
        let error_from = if ex.rejected.is_some() { 400 } else { 500 };
        let error = push_error_type(&mut attrs, bump, ex.outcome, status_code, error_from);
        timeline::push_attributes(&mut attrs, ex);
        limit_values(&mut attrs, self.value_length_limit);
        let events = timeline::events(ex, bump, |ns| self.unix_ns(ns));
        out.push(SpanView {
            trace_id: decision.trace_id,
            span_id,
            parent_span_id: decision.parent_span_id,
            trace_state: &decision.trace_state,
            flags: decision.flags,
            name: span_name(bump, method, frontend),
            kind: span::SpanKind::Server as i32,
            start_unix_ns: self.unix_ns(ex.start_ns),
            end_unix_ns: self.unix_ns(ex.end_ns.max(ex.start_ns)),
            attributes: attrs.into_bump_slice(),
            events,
            error,
        });
        for (i, client) in ex.clients.iter().enumerate() {
            // A retried request is forwarded with the same traceparent each time: its id is the
            // last attempt's (the latest sent; the tracker may file a failed attempt after it).
            let forwarded = forwarded_parent(client, decision).filter(|id| {
                ex.clients.iter().enumerate().all(|(j, other)| {
                    j == i
                        || forwarded_parent(other, decision) != Some(*id)
                        || (other.start_ns, j) < (client.start_ns, i)
                })
            });
            let backend = self.backend_names(client, names, frontend);
            let view = self.client_view(client, backend, decision, span_id, forwarded, bump);
            out.push(view);
        }
    }

    /// The backend and server a backend exchange went to, by its address and the frontend of the
    /// request it carried; none rather than a guess (counted).
    fn backend_names<'a>(
        &mut self,
        ex: &ClientExchange,
        names: Option<&'a ProxyNames>,
        frontend: Option<&str>,
    ) -> Option<(&'a str, &'a str)> {
        // Dated: names the runtime API showed only after the request was sent are no answer.
        match names.zip(ex.server).map(|(n, server)| n.server_for_sent(server, frontend, ex.start_ns)) {
            Some(ServerMatch::Named { backend, server }) => Some((backend, server)),
            Some(ServerMatch::Ambiguous) => {
                // Never a wrong name: an operator reading one would debug the wrong service.
                self.stats.ambiguous_servers += 1;
                None
            }
            Some(ServerMatch::Unknown) | None => None,
        }
    }

    fn client_view<'a>(
        &mut self,
        ex: &'a ClientExchange,
        backend: Option<(&'a str, &'a str)>,
        decision: &'a Decision,
        parent: [u8; 8],
        forwarded_id: Option<[u8; 8]>,
        bump: &'a Bump,
    ) -> SpanView<'a> {
        let mut attrs = BumpVec::with_capacity_in(14, bump);
        let target = Target::parse(&ex.request.target);
        push_request_attributes(&mut attrs, bump, Some((&ex.request, target)), ex.tls);
        if let Some(server) = ex.server {
            let ip = ip_in(bump, server);
            attrs.push(attr_str("server.address", ip));
            attrs.push(attr_int("server.port", i64::from(server.port())));
            push_peer(&mut attrs, ip, server.port());
        }
        if let Some(url) = target.full_url(&ex.request.target, scheme(ex.tls), ex.server, bump) {
            attrs.push(attr_str("url.full", url));
        }
        let status_code = ex.response.map(|r| r.status);
        if let Some(code) = status_code {
            attrs.push(attr_int("http.response.status_code", i64::from(code)));
        }
        if let Some((be, srv)) = backend {
            attrs.push(attr_str("haproxy.backend", be));
            attrs.push(attr_str("haproxy.server", srv));
        }
        // CLIENT spans: any status from 400 up is an error, per the HTTP conventions.
        let error = push_error_type(&mut attrs, bump, ex.outcome, status_code, 400);
        limit_values(&mut attrs, self.value_length_limit);
        SpanView {
            trace_id: decision.trace_id,
            span_id: forwarded_id.unwrap_or_else(|| new_span_id(&mut self.rng)),
            parent_span_id: parent,
            trace_state: &decision.trace_state,
            flags: SAMPLED | HAS_IS_REMOTE,
            name: span_name(bump, known_method(&ex.request.method), backend.map(|(be, _)| be)),
            kind: span::SpanKind::Client as i32,
            start_unix_ns: self.unix_ns(ex.start_ns),
            end_unix_ns: self.unix_ns(ex.end_ns.max(ex.start_ns)),
            attributes: attrs.into_bump_slice(),
            events: &[],
            error,
        }
    }

    /// The reference path: prost messages for the spans of `ex` (tests, benchmarks, stdout).
    pub fn build(&mut self, ex: &ServerExchange, names: Option<&ProxyNames>, out: &mut Vec<SpanRecord>) -> Built {
        let Some(decision) = self.decide(ex) else { return Built::Dropped };
        let bump = Bump::new();
        let mut views = BumpVec::new_in(&bump);
        self.views(ex, &decision, names, &bump, &mut views);
        out.extend(views.iter().map(|v| SpanRecord { tgid: ex.tgid, span: v.to_prost() }));
        Built::Sampled { spans: views.len() }
    }
}

/// The OTLP flags of a SERVER span: sampled, W3C's random flag as given, and whether its parent
/// is remote (it has one only when the request came with a valid `traceparent`).
fn server_flags(parent: Option<&TraceParent>, random: u8) -> u32 {
    match parent {
        Some(p) => SAMPLED | u32::from(p.flags & FLAG_RANDOM) | HAS_IS_REMOTE | IS_REMOTE,
        None => SAMPLED | u32::from(random & FLAG_RANDOM) | HAS_IS_REMOTE,
    }
}

/// The trace context `HAProxy` forwarded on its own: the `traceparent` of the first backend
/// request that carries a valid one, when it is not the client's (HAProxy configured with `tracetap
/// haproxy-snippet` sets a new parent id on every request). For a request `HAProxy` answered
/// itself, the one its response carries (`--response`): nothing else adds one to a local answer.
/// A backend's own response is never read for it. `None`: `HAProxy` forwarded the client's
/// context unchanged, or none.
#[must_use]
pub fn propagated_context(ex: &ServerExchange, incoming: Option<&TraceParent>) -> Option<TraceParent> {
    let own = |tp: &TraceParent| incoming.is_none_or(|i| (i.trace_id, i.parent_id) != (tp.trace_id, tp.parent_id));
    if ex.clients.is_empty() {
        return ex.response.and_then(|r| r.traceparent).filter(own);
    }
    ex.clients.iter().find_map(|c| c.request.parsed_traceparent).filter(own)
}

/// The parent id a backend request carried in the decided trace, when `HAProxy` propagated it.
fn forwarded_parent(client: &ClientExchange, decision: &Decision) -> Option<[u8; 8]> {
    if !decision.propagated {
        return None;
    }
    client.request.parsed_traceparent.filter(|tp| tp.trace_id == decision.trace_id).map(|tp| tp.parent_id)
}

/// A new random trace id (non-zero; the W3C random flag may be set on spans that carry it).
#[must_use]
fn new_trace_id(rng: &mut fastrand::Rng) -> [u8; 16] {
    loop {
        let id = rng.u128(..).to_be_bytes();
        if id != [0; 16] {
            return id;
        }
    }
}

/// A new random span id (non-zero).
#[must_use]
fn new_span_id(rng: &mut fastrand::Rng) -> [u8; 8] {
    loop {
        let id = rng.u64(..).to_be_bytes();
        if id != [0; 8] {
            return id;
        }
    }
}

/// `{method} {proxy}` when HAProxy's name for the frontend or backend is known, else `{method}`.
fn span_name<'a>(bump: &'a Bump, method: &'a str, proxy: Option<&str>) -> &'a str {
    match proxy {
        // Two copies into the arena; `format!` would run the formatting machinery per span.
        Some(p) => {
            let mut name = BumpString::with_capacity_in(method.len() + 1 + p.len(), bump);
            name.push_str(method);
            name.push(' ');
            name.push_str(p);
            name.into_bump_str()
        }
        None => method,
    }
}

/// Adds `error.type` for an exchange cut short, or answered with a status of `error_from` or
/// more; returns whether the span is an error.
fn push_error_type<'a>(
    attrs: &mut BumpVec<'a, Attr<'a>>,
    bump: &'a Bump,
    outcome: Outcome,
    status_code: Option<u16>,
    error_from: u16,
) -> bool {
    let error_type = match (outcome.error_type(), status_code) {
        (Some(e), _) => e,
        (None, Some(code)) if code >= error_from => bumpalo::format!(in bump, "{}", code).into_bump_str(),
        _ => return false,
    };
    attrs.push(attr_str("error.type", error_type));
    true
}

/// The textual IP of an address, in the arena.
fn ip_in(bump: &Bump, addr: SocketAddr) -> &str {
    let mut text = BumpString::with_capacity_in(15, bump);
    push_ip(&mut text, addr.ip());
    text.into_bump_str()
}

/// Methods of RFC 9110 and PATCH keep their name; anything else is `_OTHER`, per the conventions.
fn known_method(method: &str) -> &str {
    match method {
        "GET" | "HEAD" | "POST" | "PUT" | "DELETE" | "CONNECT" | "OPTIONS" | "TRACE" | "PATCH" => method,
        _ => "_OTHER",
    }
}

fn attr_str<'a>(key: &'static str, value: &'a str) -> Attr<'a> {
    Attr { key, value: Value::Str(value) }
}

fn attr_int(key: &'static str, value: i64) -> Attr<'static> {
    Attr { key, value: Value::Int(value) }
}

/// `url.scheme` of an exchange: what the client (SERVER spans) or `HAProxy` (CLIENT spans) spoke.
fn scheme(tls: Option<TlsInfo>) -> &'static str {
    if tls.is_some() { "https" } else { "http" }
}

/// The request's attributes; `target` is `r.target` parsed (the caller may need it again); `tls`
/// the session the exchange ran in.
fn push_request_attributes<'a>(
    attrs: &mut BumpVec<'a, Attr<'a>>,
    bump: &'a Bump,
    request: Option<(&'a RequestHead, Target<'a>)>,
    tls: Option<TlsInfo>,
) {
    if let Some(version) = tls.and_then(|t| t.version) {
        attrs.push(attr_str("tls.protocol.name", "tls"));
        attrs.push(attr_str("tls.protocol.version", version));
    }
    let Some((r, target)) = request else {
        attrs.push(attr_str("http.request.method", "_OTHER"));
        return;
    };
    if r.truncated {
        // Headers past the capture window (a traceparent among them) were not seen.
        attrs.push(Attr { key: "tracetap.head_truncated", value: Value::Bool(true) });
    }
    let method = known_method(&r.method);
    attrs.push(attr_str("http.request.method", method));
    if method != r.method {
        attrs.push(attr_str("http.request.method_original", &r.method));
    }
    attrs.push(attr_str("url.path", target.path()));
    if let Some(q) = target.query() {
        attrs.push(attr_str("url.query", scrub_query(q, bump)));
    }
    attrs.push(attr_str("url.scheme", scheme(tls)));
    attrs.push(attr_str("network.protocol.version", r.version.as_str()));
}

/// Applies the attribute value length limit to every string value; cut values stay borrowed.
/// Resource attributes are exempt, as the SDK specification says.
fn limit_values(attrs: &mut [Attr<'_>], limit: Option<usize>) {
    let Some(limit) = limit else { return };
    for attr in attrs {
        if let Value::Str(s) = &mut attr.value {
            *s = truncate_chars(s, limit);
        }
    }
}

fn push_peer<'a>(attrs: &mut BumpVec<'a, Attr<'a>>, ip: &'a str, port: u16) {
    attrs.push(attr_str("network.peer.address", ip));
    attrs.push(attr_int("network.peer.port", i64::from(port)));
}

/// Splits a Host header into name and port (`[::1]:80`, `example.com:8080`, `example.com`).
fn split_host(host: &str) -> (&str, Option<u16>) {
    if let Some(rest) = host.strip_prefix('[')
        && let Some((addr, after)) = rest.split_once(']')
    {
        return (addr, after.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => match port.parse() {
            Ok(p) => (name, Some(p)),
            Err(_) => (host, None),
        },
        _ => (host, None),
    }
}

#[cfg(test)]
mod tests;
