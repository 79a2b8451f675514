//! HTTP/1 connections: requests and responses framed from each call's bytes (`framing`), heads
//! parsed (`head`), responses paired with requests in order, and what a client sent that does not
//! frame as a request kept for `HAProxy`'s answer to it (a rejected request, see
//! `crate::rejected`). The HTTP/2 counterpart is the `http2` module; both report to the same
//! exchange records through the parent module.

use crate::exchange::Outcome;
use crate::framing::{BodyFraming, Cursor, FramingError, Step};
use crate::head::{self, ResponseHead};
use crate::rejected::{Rejected, is_rejection_status};

use super::{
    AtHead, Chunk, Connection, Ctx, Direction, Kind, MAX_UNANSWERED_RECORDS, OpaqueCause, Role, SAMPLED_OUT,
    SyscallEvent, Tracker, at_head, classify, mark_opaque,
};
use crate::trace_context::TraceParent;

/// What the framing loop does after a step: go on with the call's bytes, or stop there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flow {
    Continue,
    Stop,
}

impl Tracker {
    /// Frames the messages of `kind` flowing in `dir` on the connection (requests a client sends
    /// or `HAProxy` forwards, responses a server sends or `HAProxy` relays); true when a head or a
    /// message end was found (which marks the exchange active), false for bytes inside a message.
    /// One loop for both kinds; what a head, an error or a message end means is per kind.
    pub(super) fn frame(&mut self, ctx: Ctx, chunk: Chunk<'_>, dir: Direction, kind: Kind) -> bool {
        if self.begin_call(ctx, chunk, dir, kind) == Flow::Stop {
            return false;
        }
        let mut cursor = Cursor::new(chunk);
        let mut found_message = false;
        loop {
            let Some(conn) = self.conns.get_mut(&ctx.key) else { return found_message };
            let role = conn.role;
            let (framer, start) = conn.direction(dir);
            let first_byte = framer.is_idle() && start.is_none() && !cursor.is_empty();
            if first_byte {
                *start = Some(ctx.ts);
            }
            let step = framer.step(&mut cursor);
            // (After the step, which touches only the framer: one connection lookup per step.)
            if first_byte && kind == Kind::Response {
                self.response_started(ctx, role);
            }
            let flow = match (step, kind) {
                (Step::NeedMore, _) => Flow::Stop,
                (Step::MessageEnd, Kind::Request) => {
                    found_message = true;
                    Flow::Continue
                }
                (Step::MessageEnd, Kind::Response) => {
                    found_message = true;
                    self.response_done(ctx, role, Outcome::Complete);
                    Flow::Continue
                }
                (Step::Head, Kind::Request) => {
                    found_message = true;
                    self.request_head(ctx, dir, role);
                    Flow::Continue
                }
                (Step::Head, Kind::Response) => {
                    found_message = true;
                    self.response_head_framed(ctx, dir, role);
                    Flow::Continue
                }
                (Step::Error(error), Kind::Request) => self.request_error(ctx, dir, role, error),
                (Step::Error(_), Kind::Response) => self.response_error(ctx),
            };
            if flow == Flow::Stop {
                return found_message;
            }
        }
    }

    /// Before the first step over a call: a direction that lost its framing starts over at a
    /// message start; a client that keeps sending what is not HTTP turns the connection opaque.
    fn begin_call(&mut self, ctx: Ctx, chunk: Chunk<'_>, dir: Direction, kind: Kind) -> Flow {
        let Some(conn) = self.conns.get_mut(&ctx.key) else { return Flow::Stop };
        conn.resync_at_message_start(dir, chunk, kind);
        if kind == Kind::Request && conn.unanswered_garbage() {
            // Not a client HAProxy answers (a `mode tcp` stream the names did not show, a one-way
            // protocol): opaque after all, so its bytes stop being copied.
            conn.role = Role::Opaque;
            conn.opaque_cause = OpaqueCause::Other;
            conn.rejected = None;
            self.stats.opaque_connections += 1;
            mark_opaque(&mut self.opaque_marks, ctx.key, conn.opened_ns);
            return Flow::Stop;
        }
        Flow::Continue
    }

    /// A request head was framed: parsed, and a frontend or backend exchange opened with it.
    fn request_head(&mut self, ctx: Ctx, dir: Direction, role: Role) {
        let mut request = self.linker.spare_head();
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        let (framer, start) = conn.direction(dir);
        let started = start.take().unwrap_or(ctx.ts);
        let (drop_rule, waiting, linker) = (self.limits.sampled_out, &self.sampled_out, &self.linker);
        let mut decided = AtHead::Kept;
        let parsed = head::parse_request_unless(framer.head_bytes(), &mut request, |head| {
            decided = at_head(drop_rule, waiting, linker, role, ctx.key.0, head);
            !decided.is_kept()
        });
        if parsed.is_ok() {
            request.truncated = framer.head_truncated();
            self.stats.truncated_heads += u64::from(request.truncated);
            framer.set_body(request.framing);
            match role {
                Role::Frontend => self.new_h1_front(ctx, request, started, decided),
                _ => {
                    self.new_backend(ctx, request, started, decided);
                }
            }
        } else {
            self.stats.parse_errors += 1;
            let rejected = (role == Role::Frontend).then(|| Rejected::failed(framer.head_bytes(), started));
            // Give up on this direction until the next request line.
            framer.abandon();
            if let Some(rejected) = rejected {
                conn.rejected = Some(rejected);
            }
            self.linker.return_head(request);
        }
    }

    /// A frontend read the probes dropped at its head ([`Op::DroppedRequest`](super::Op)): one whole
    /// request head without a body, not copied. At a message start it is that request, paired
    /// like one dropped here. Inside a body that has room for them (a body whose bytes looked like a
    /// head), its bytes are that body's, unseen, as those of a read the capture window cut.
    /// Otherwise (the end of a head or body, then a head, the probes could not tell) it is a gap:
    /// where the next message starts is not known, and the gap is counted.
    pub(super) fn dropped_request(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>, len: u64, context: TraceParent) {
        // The probes drop heads on accepted connections only: one whose accept record was lost is a
        // frontend too.
        let conn = self.conns.entry(key).or_insert_with(|| Connection::new(Role::Frontend, None));
        if conn.take_seq(ev.seq, &mut self.stats) {
            self.capture_gap(key, ev.ts_ns);
        }
        let conn = self.conns.get_mut(&key).expect("present");
        if conn.role == Role::Unknown {
            conn.role = Role::Frontend;
        }
        if conn.role != Role::Frontend || conn.h2.is_some() {
            // Bytes of a connection this tracker does not frame as HTTP/1 (opaque: not wanted).
            self.stats.parse_errors += u64::from(conn.role != Role::Opaque);
            return;
        }
        let ctx = Ctx { key, tid: ev.tid, ts: ev.ts_ns };
        conn.expect_proxy_header = false;
        let (framer, start) = conn.direction(Direction::Ingress);
        if framer.is_desynced() {
            // The probes saw a request line: a message start.
            framer.resync();
        }
        if !framer.is_idle() {
            if !framer.takes_unseen(len) {
                self.capture_gap(key, ev.ts_ns);
            } else if !self.frame(ctx, Chunk { known: &[], total: len, tail: &[] }, Direction::Ingress, Kind::Request) {
                self.touch(key, Role::Frontend, ev.ts_ns);
            }
            return;
        }
        *start = None;
        self.stats.requests_dropped_in_probe += 1;
        self.sample_out_front(ctx, 0, context);
        self.conns.get_mut(&key).expect("present").fronts.push_back(SAMPLED_OUT);
    }

    /// Requests that do not frame: what a client sent is kept for `HAProxy`'s answer to it (the
    /// span of a rejected request); bytes on a connection that never spoke HTTP make it opaque.
    fn request_error(&mut self, ctx: Ctx, dir: Direction, role: Role, error: FramingError) -> Flow {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        let in_tls = conn.tls.is_some();
        let (framer, start) = conn.direction(dir);
        let started = start.take().unwrap_or(ctx.ts);
        // A client's request HAProxy will reject (its answer makes the span), unless the bytes are
        // a TLS handshake the TLS probes have not claimed yet. A head the window cut or too long
        // for the tracker is incomplete as far as it knows.
        let failed = framer.failed_bytes();
        let rejected = (role == Role::Frontend && !failed.is_empty() && (in_tls || !starts_like_tls(failed))).then(
            || match error {
                FramingError::HeadTruncated | FramingError::HeadTooLarge => Rejected::pending(failed, started),
                FramingError::BadHead => Rejected::not_http(failed, started),
                FramingError::BadChunk => Rejected::failed(failed, started),
            },
        );
        let rejected_here = rejected.is_some();
        if rejected_here {
            conn.rejected = rejected;
        }
        if conn.spoke_http || rejected_here {
            self.stats.parse_errors += 1;
            return Flow::Continue;
        }
        self.turn_opaque(ctx.key);
        Flow::Stop
    }

    /// Responses that do not frame: a parse error on a connection that spoke HTTP, else the
    /// connection speaks something else and turns opaque.
    fn response_error(&mut self, ctx: Ctx) -> Flow {
        if self.conns.get(&ctx.key).is_some_and(|c| c.spoke_http) {
            self.stats.parse_errors += 1;
            return Flow::Continue;
        }
        self.turn_opaque(ctx.key);
        Flow::Stop
    }

    /// The connection `key` does not speak HTTP after all: opaque from now on.
    fn turn_opaque(&mut self, key: (u32, i32)) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        conn.role = Role::Opaque;
        conn.opaque_cause = if conn.tls.is_none() { OpaqueCause::FirstBytes } else { OpaqueCause::Other };
        self.stats.opaque_connections += 1;
        mark_opaque(&mut self.opaque_marks, key, conn.opened_ns);
    }

    /// The first byte of a response: on a backend, the server answered something, parsable or not.
    fn response_started(&mut self, ctx: Ctx, role: Role) {
        if role != Role::Backend {
            return;
        }
        let oldest = self.conns.get(&ctx.key).and_then(|c| c.backs.front().copied());
        if let Some(back) = oldest.and_then(|id| self.linker.back_mut(id)) {
            back.exchange.response_start_ns.get_or_insert(ctx.ts);
        }
    }

    /// A response head was framed: parsed and recorded on its exchange, its body framed as it
    /// says; an upgrade turns both directions into a tunnel.
    fn response_head_framed(&mut self, ctx: Ctx, dir: Direction, role: Role) {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        // The answer to a request dropped at its head is only framed.
        let parse = if conn.answers_sampled_out(role) { head::parse_response_framing } else { head::parse_response };
        let (framer, start) = conn.direction(dir);
        let started = start.take().unwrap_or(ctx.ts);
        let Ok(response) = parse(framer.head_bytes()) else {
            self.stats.parse_errors += 1;
            framer.abandon();
            return;
        };
        let framing = self.response_head(ctx, role, response, started);
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        conn.spoke_http = true;
        conn.direction(dir).0.set_body(framing);
        if framing == BodyFraming::Tunnel {
            // Both directions now carry opaque bytes.
            conn.direction(dir.reverse()).0.enter_tunnel();
            mark_opaque(&mut self.opaque_marks, ctx.key, conn.opened_ns);
            self.response_done(ctx, role, Outcome::Upgraded);
        } else if framing == BodyFraming::Empty && !response.is_interim() {
            self.response_done(ctx, role, Outcome::Complete);
        }
    }

    /// Records a response head on the oldest open request (HTTP/1 pairs in order); returns how
    /// its body is framed.
    fn response_head(&mut self, ctx: Ctx, role: Role, response: ResponseHead, started: u64) -> BodyFraming {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        if conn.answers_sampled_out(role) {
            // Only paired: nothing of it is kept.
            return response.framing("GET");
        }
        if role == Role::Frontend {
            let id = if let Some(id) = conn.fronts.front() {
                *id
            } else {
                // HAProxy answered without a request we parsed (408, 400, ...), or this answers a
                // request lost in a capture gap.
                self.stats.unpaired_responses += 1;
                if (conn.ingress.is_idle() && !conn.ingress.is_desynced()) || conn.egress_resynced_after_gap() {
                    // Not a byte of a request: a TCP probe or port scan HAProxy answered with 400
                    // on close. Counted, not traced (HAProxy's `option http-ignore-probes`).
                    return response.framing("GET");
                }
                // A request HAProxy rejected: its span starts with the request's first byte and
                // shows what the client sent. Any other answer means HAProxy took a request the
                // tracker could not parse: no claim about it, but the span still starts there.
                let taken = conn.rejected.take();
                let started = taken.as_ref().map(|r| r.start_ns).or(conn.ingress_start).unwrap_or(ctx.ts);
                let rejected = taken.filter(|_| is_rejection_status(response.status)).or_else(|| {
                    // Answered before its head was complete (a timeout, a head too long).
                    let pending = conn.ingress.pending_head();
                    (is_rejection_status(response.status) && !pending.is_empty())
                        .then(|| Rejected::pending(pending, started))
                });
                let id = self.linker.insert_front(ctx, None, started, conn.front_conn());
                if let (Some(rejected), Some(front)) = (rejected, self.linker.front_mut(id)) {
                    front.exchange.rejected = Some(rejected);
                }
                conn.fronts.push_back(id);
                id
            };
            self.linker.front_response_head(id, ctx, response)
        } else {
            let Some(back_id) = conn.backs.front().copied() else {
                self.stats.unpaired_responses += 1;
                return response.framing("GET");
            };
            self.linker.back_response_head(back_id, ctx, response, started)
        }
    }

    fn response_done(&mut self, ctx: Ctx, role: Role, outcome: Outcome) {
        let conn = self.conns.get_mut(&ctx.key).expect("present");
        if conn.answers_sampled_out(role) {
            // (Called for final responses only: an interim one frames no body.)
            if role == Role::Frontend {
                conn.fronts.pop_front();
                if let Some((_, context)) = conn.sampled_out_contexts.pop_front() {
                    self.sampled_out.release(ctx.key.0, &context);
                }
            } else {
                conn.backs.pop_front();
                conn.free_since_ns = Some(ctx.ts);
            }
            return;
        }
        if role == Role::Frontend {
            let Some(id) = conn.fronts.front().copied() else { return };
            if self.linker.front(id).is_some_and(|f| !f.responding) {
                return; // an interim response ended, the final one is still to come
            }
            conn.fronts.pop_front();
            self.linker.finish_front(id, ctx.ts, outcome);
        } else {
            let Some(id) = conn.backs.front().copied() else { return };
            if self.linker.back(id).is_some_and(|b| b.exchange.response.is_none()) {
                return;
            }
            conn.backs.pop_front();
            conn.free_since_ns = Some(ctx.ts);
            self.linker.end_backend(id, ctx.ts, outcome);
        }
    }
}

impl Connection {
    /// At the first step over a call whose bytes begin with a `kind` start line, a direction that
    /// lost its framing (a parse error, a capture gap) starts over there.
    fn resync_at_message_start(&mut self, dir: Direction, chunk: Chunk<'_>, kind: Kind) {
        let (framer, _) = self.direction(dir);
        if framer.is_desynced() && classify(chunk.known) == Some(kind) {
            framer.resync();
        }
    }

    /// Counts a record of a client whose first bytes were not HTTP and that `HAProxy` has not
    /// answered yet; true past [`MAX_UNANSWERED_RECORDS`].
    fn unanswered_garbage(&mut self) -> bool {
        let desynced = self.ingress.is_desynced();
        match self.rejected.as_mut() {
            // Only bytes that never looked like HTTP: a request the window cut may stream a body
            // HAProxy takes.
            Some(rejected) if !self.spoke_http && desynced && rejected.not_http => {
                rejected.records_since = rejected.records_since.saturating_add(1);
                usize::from(rejected.records_since) > MAX_UNANSWERED_RECORDS
            }
            _ => false,
        }
    }
}

/// True for bytes that begin like a TLS handshake record (content type 22, version 3.x).
fn starts_like_tls(bytes: &[u8]) -> bool {
    bytes.starts_with(&[0x16, 0x03])
}
