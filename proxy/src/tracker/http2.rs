//! HTTP/2 connections in the tracker: a connection whose client starts with the preface is
//! decoded by two [`h2::Decoder`]s (one per direction, each with its own HPACK state), and each
//! stream is one exchange, paired by stream id instead of in order.
//!
//! - Frontend streams are requests `HAProxy` read, made exactly like HTTP/1 ones
//!   ([`Tracker::new_front`]), so they are link candidates for the backend requests they cause,
//!   whatever version those are written in; backend streams (`proto h2`) are backend requests.
//! - A stream's exchange ends when the server's side of it ends (`END_STREAM` on a response
//!   HEADERS, DATA or trailers), when either side resets it ([`Outcome::StreamReset`]), or when
//!   the server's `GOAWAY` leaves it unprocessed ([`Outcome::GoAway`]). Only client-initiated
//!   streams carry exchanges, so only the server's `GOAWAY` concerns them.
//! - HPACK state cannot be rebuilt: a desynced decoder or a capture gap ends the open streams
//!   with [`Outcome::CaptureGap`] and makes the connection opaque ([`Tracker::h2_lost`]).

use super::{AtHead, Connection, Ctx, Direction, Role, SAMPLED_OUT, Tracker, TrackerStats, at_head, mark_opaque};
use crate::exchange::Outcome;
use crate::framing::{BodyFraming, Chunk, Framer};
use crate::h2;

/// The HTTP/2 side of a connection: one decoder per direction (each has its own HPACK state),
/// and the exchange each open stream carries. Its exchange ids are also in the connection's
/// `fronts` or `backs`, so that a close or an expiry ends them as on HTTP/1.
#[derive(Debug)]
pub(super) struct H2Connection {
    /// The client's bytes: frontend ingress, backend egress.
    pub(super) requests: h2::Decoder,
    /// The server's bytes.
    pub(super) responses: h2::Decoder,
    /// Open streams and their exchange (a frontend exchange id on a frontend, a backend one on a
    /// backend). Few at a time (`HAProxy` allows 100 by default): a list is enough.
    pub(super) streams: Vec<(u32, u64)>,
}

impl H2Connection {
    pub(super) fn new() -> Self {
        Self {
            requests: h2::Decoder::new(h2::Sender::Client),
            responses: h2::Decoder::new(h2::Sender::Server),
            streams: Vec::new(),
        }
    }

    pub(super) fn exchange(&self, stream: u32) -> Option<u64> {
        self.streams.iter().find(|(s, _)| *s == stream).map(|(_, id)| *id)
    }
}

/// True for the direction that carries the client's bytes (requests).
fn is_request_direction(role: Role, dir: Direction) -> bool {
    matches!((role, dir), (Role::Frontend, Direction::Ingress) | (Role::Backend, Direction::Egress))
}

impl Connection {
    /// Decides, on the first bytes of a connection that has not spoken yet, whether it speaks
    /// HTTP/2: the client's preface (`"PRI"` is enough, no other method starts so), or the
    /// server's (a SETTINGS frame, which a server may write before it reads the client's).
    /// Shorter bytes that may start either the preface or an HTTP/1 request ("P", "PR") are held
    /// back until the next call. Returns how many held bytes (`PREFACE[..n]`) to handle before
    /// `chunk`, or `None` when `chunk` is held back too.
    pub(super) fn detect_h2(
        &mut self,
        role: Role,
        dir: Direction,
        chunk: Chunk<'_>,
        stats: &mut TrackerStats,
    ) -> Option<usize> {
        let held = usize::from(std::mem::take(&mut self.preface_held));
        let fresh = |framer: &Framer, start: Option<u64>| framer.is_idle() && start.is_none();
        if self.h2.is_some()
            || self.spoke_http
            || !matches!(role, Role::Frontend | Role::Backend)
            || !self.fronts.is_empty()
            || !self.backs.is_empty()
            || !fresh(&self.ingress, self.ingress_start)
            || !fresh(&self.egress, self.egress_start)
        {
            return Some(held);
        }
        if !is_request_direction(role, dir) {
            if held == 0 && h2::starts_with_settings(chunk.known) {
                self.h2 = Some(Box::new(H2Connection::new()));
                stats.h2_connections += 1;
            }
            // Held client bytes stay held: they are not this direction's.
            self.preface_held = held as u8;
            return Some(0);
        }
        let known = chunk.known;
        let rest = &h2::PREFACE[held..];
        let continues = rest.starts_with(&known[..known.len().min(rest.len())]);
        if continues && held + known.len() < 3 && !known.is_empty() && chunk.total == known.len() as u64 {
            self.preface_held = (held + known.len()) as u8;
            return None;
        }
        if continues && held + known.len() >= 3 {
            self.h2 = Some(Box::new(H2Connection::new()));
            stats.h2_connections += 1;
        }
        Some(held)
    }
}

impl Tracker {
    /// Decodes one call's bytes of an HTTP/2 connection; true when they held an event (which
    /// marks exchanges active).
    pub(super) fn h2_data(&mut self, ctx: Ctx, role: Role, chunk: Chunk<'_>, dir: Direction) -> bool {
        let requests = is_request_direction(role, dir);
        let mut events = std::mem::take(&mut self.h2_events);
        let Some(h2) = self.conns.get_mut(&ctx.key).and_then(|c| c.h2.as_mut()) else { return false };
        let decoder = if requests { &mut h2.requests } else { &mut h2.responses };
        let result = decoder.feed(chunk, &mut events, self.linker.head_pool());
        let found = !events.is_empty();
        for event in events.drain(..) {
            self.h2_event(ctx, role, requests, event);
        }
        self.h2_events = events;
        if result.is_err() {
            self.h2_lost(ctx.key, ctx.ts);
        }
        found
    }

    fn h2_event(&mut self, ctx: Ctx, role: Role, requests: bool, event: h2::Event) {
        use h2::Event;
        match event {
            Event::Request { stream, head, .. } if requests => {
                self.stats.h2_streams += 1;
                let open =
                    self.conns.get(&ctx.key).and_then(|c| c.h2.as_ref()).is_some_and(|h| h.exchange(stream).is_some());
                if open {
                    // A second request head on an open stream: malformed.
                    self.stats.parse_errors += 1;
                    self.linker.return_head(head);
                    return;
                }
                let decided = at_head(self.limits.sampled_out, &self.sampled_out, &self.linker, role, ctx.key.0, &head);
                let id = match (role, decided) {
                    (Role::Frontend, AtHead::SampledOut(context)) => {
                        self.linker.return_head(head);
                        self.sample_out_front(ctx, stream, context);
                        SAMPLED_OUT
                    }
                    (Role::Frontend, _) => self.new_front(ctx, head, ctx.ts),
                    _ => self.new_backend(ctx, head, ctx.ts, decided),
                };
                if let Some(h2) = self.conns.get_mut(&ctx.key).and_then(|c| c.h2.as_mut()) {
                    h2.streams.push((stream, id));
                }
            }
            Event::Response { stream, head, end_stream } if !requests => {
                let Some(id) = self.conns.get(&ctx.key).and_then(|c| c.h2.as_ref()).and_then(|h| h.exchange(stream))
                else {
                    // A stream whose request head was malformed, or that no request opened.
                    self.stats.unpaired_responses += 1;
                    return;
                };
                let framing = match role {
                    // A backend stream sampled out at its head: only paired.
                    _ if id == SAMPLED_OUT => head.framing("GET"),
                    Role::Frontend => self.linker.front_response_head(id, ctx, head),
                    _ => self.linker.back_response_head(id, ctx, head, ctx.ts),
                };
                if framing == BodyFraming::Tunnel {
                    // CONNECT: the stream now carries a tunnel; the exchange ends at its head as on
                    // HTTP/1.
                    self.h2_stream_done(ctx, role, stream, Outcome::Upgraded);
                } else if end_stream && !head.is_interim() {
                    self.h2_stream_done(ctx, role, stream, Outcome::Complete);
                }
            }
            Event::Trailers { stream } | Event::StreamEnd { stream } if !requests => {
                self.h2_stream_done(ctx, role, stream, Outcome::Complete);
            }
            Event::Reset { stream, code } => {
                self.stats.h2_resets += 1;
                self.h2_stream_done(ctx, role, stream, Outcome::StreamReset(code));
            }
            Event::GoAway { last_stream, code } => {
                self.stats.h2_goaways += 1;
                if !requests {
                    let above: Vec<u32> = self
                        .conns
                        .get(&ctx.key)
                        .and_then(|c| c.h2.as_ref())
                        .map(|h| h.streams.iter().map(|(s, _)| *s).filter(|s| *s > last_stream).collect())
                        .unwrap_or_default();
                    for stream in above {
                        self.h2_stream_done(ctx, role, stream, Outcome::GoAway(code));
                    }
                }
            }
            Event::Malformed { stream, end_stream } => {
                self.stats.parse_errors += 1;
                if end_stream && !requests {
                    self.h2_stream_done(ctx, role, stream, Outcome::Complete);
                }
            }
            // The end of the client's side of a stream: the request is complete, nothing waits on
            // it. (Heads of the other kind cannot come: each decoder reports only its sender's.)
            Event::Request { head, .. } => self.linker.return_head(head),
            Event::Response { .. } | Event::Trailers { .. } | Event::StreamEnd { .. } => {}
        }
    }

    /// Ends the exchange of `stream`, if it is open.
    fn h2_stream_done(&mut self, ctx: Ctx, role: Role, stream: u32, outcome: Outcome) {
        let Some(conn) = self.conns.get_mut(&ctx.key) else { return };
        let Some(h2) = conn.h2.as_mut() else { return };
        let Some(pos) = h2.streams.iter().position(|(s, _)| *s == stream) else { return };
        let (_, id) = h2.streams.swap_remove(pos);
        if id == SAMPLED_OUT && role == Role::Frontend {
            // A request dropped at its head: its context no longer waits.
            if let Some(at) = conn.sampled_out_contexts.iter().position(|(s, _)| *s == stream) {
                let (_, context) = conn.sampled_out_contexts.remove(at).expect("present");
                self.sampled_out.release(ctx.key.0, &context);
            }
            return;
        }
        let ids = if role == Role::Frontend { &mut conn.fronts } else { &mut conn.backs };
        if let Some(pos) = ids.iter().position(|i| *i == id) {
            ids.remove(pos);
        }
        if role == Role::Frontend {
            self.linker.finish_front(id, ctx.ts, outcome);
        } else {
            self.linker.end_backend(id, ctx.ts, outcome);
        }
    }

    /// The HPACK state of the HTTP/2 connection `key` is lost (a decoder desynced, or a capture
    /// gap): its open streams end with [`Outcome::CaptureGap`] and it becomes opaque until closed.
    pub(super) fn h2_lost(&mut self, key: (u32, i32), ts: u64) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        self.stats.h2_desyncs += 1;
        conn.h2 = None;
        conn.role = Role::Opaque;
        mark_opaque(&mut self.opaque_marks, key, conn.opened_ns);
        self.lose_open_exchanges(key, ts);
    }
}
