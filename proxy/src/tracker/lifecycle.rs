//! A connection's life outside its bytes: TLS declared on it, a record missing from its sequence
//! (a capture gap), its peer ending the stream or going away, and its close. Each ends the
//! exchanges it must, with the outcome the moment says.

use super::{Connection, OpaqueCause, Outcome, Role, SAMPLED_OUT, SyscallEvent, Tracker, mark_opaque};
use crate::exchange::TlsInfo;
use crate::framing::Framer;

impl Tracker {
    /// The connection `key` runs in TLS: its exchanges carry `tls`, and its bytes from now on are
    /// the plaintext, parsed from scratch (a PROXY header came before the handshake, if any).
    pub(super) fn tls(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>, version: u16) {
        if ev.seq != 0 {
            self.check_sequence(key, ev);
        }
        let conn = self.conns.entry(key).or_insert_with(|| Connection::new(Role::Unknown, None));
        conn.tls = Some(TlsInfo::from_wire(version));
        conn.expect_proxy_header = false;
        if conn.role == Role::Opaque && conn.opaque_cause == OpaqueCause::FirstBytes {
            // The bytes before were the handshake's ciphertext, not another protocol. The probes
            // dropped the connection's opaque mark when they bound it (so that its plaintext is
            // copied from the first record on); the agent forgets its mark on this record too.
            conn.role = Role::Unknown;
            conn.opaque_cause = OpaqueCause::Other;
        } else if conn.role == Role::Opaque {
            // Opaque for another reason (`mode tcp`): marked again, as binding dropped the mark.
            let opened_ns = conn.opened_ns;
            mark_opaque(&mut self.opaque_marks, key, opened_ns);
            return;
        }
        if conn.role != Role::Opaque {
            conn.ingress = Framer::new();
            conn.egress = Framer::new();
            conn.ingress_start = None;
            conn.egress_start = None;
            conn.preface_held = 0;
            conn.h2 = None;
            conn.rejected = None;
        }
    }

    /// Detects a record missing before `ev` on its connection. The first numbered record of a
    /// connection the tracker does not know (its `accept`/`connect` was lost, or it predates us)
    /// starts the count.
    pub(super) fn check_sequence(&mut self, key: (u32, i32), ev: &SyscallEvent<'_>) {
        if let Some(conn) = self.conns.get_mut(&key)
            && conn.take_seq(ev.seq, &mut self.stats)
        {
            self.capture_gap(key, ev.ts_ns);
        }
    }

    /// A record of this connection was lost: bytes of either direction may be missing. Its open
    /// exchanges end as [`Outcome::CaptureGap`] (a response seen later cannot be told from the
    /// answer to a later request) and its framing starts over at the next message start.
    pub(super) fn capture_gap(&mut self, key: (u32, i32), ts: u64) {
        self.stats.capture_gaps += 1;
        let Some(conn) = self.conns.get_mut(&key) else { return };
        if matches!(conn.role, Role::Opaque | Role::Unknown) {
            return;
        }
        if conn.h2.is_some() {
            // HTTP/2 has no message start to resynchronise at, and the HPACK state is lost.
            self.h2_lost(key, ts);
            return;
        }
        conn.ingress.abandon();
        conn.egress.abandon();
        conn.gapped = true;
        conn.ingress_start = None;
        conn.egress_start = None;
        self.lose_open_exchanges(key, ts);
    }

    /// Bytes of the connection `key` were lost: its open exchanges end as
    /// [`Outcome::CaptureGap`], and links guessed in its process are given up (the lost bytes may
    /// have held a frontend request whose backend request would link to another).
    pub(super) fn lose_open_exchanges(&mut self, key: (u32, i32), ts: u64) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        conn.release_sampled_out(key.0, &mut self.sampled_out);
        let fronts: Vec<u64> = conn.fronts.drain(..).filter(|id| *id != SAMPLED_OUT).collect();
        let backs: Vec<u64> = conn.backs.drain(..).filter(|id| *id != SAMPLED_OUT).collect();
        if !self.linker.quarantined(ts) {
            // (In a quarantine no guessed link exists: they were given up when it began.)
            self.linker.taint_guessed_links(key.0);
        }
        self.stats.gap_exchanges += (fronts.len() + backs.len()) as u64;
        for id in fronts {
            self.linker.finish_front(id, ts, Outcome::CaptureGap);
        }
        for id in backs {
            self.linker.end_backend(id, ts, Outcome::CaptureGap);
        }
    }

    /// The peer closed its side of the connection `key` (a read returned end of stream: `clean`),
    /// or is gone (a read or write failed).
    pub(super) fn end_of_stream(&mut self, key: (u32, i32), ts: u64, clean: bool) {
        let Some(conn) = self.conns.get_mut(&key) else { return };
        match conn.role {
            Role::Backend => {
                // Only a clean end of stream completes a body delimited by the close.
                if clean
                    && conn.ingress.finish()
                    && let Some(id) = conn.backs.pop_front()
                {
                    self.linker.end_backend(id, ts, Outcome::Complete);
                }
                let conn = self.conns.get_mut(&key).expect("present");
                if conn.h2.is_some() {
                    return;
                }
                // Nothing more can come from the server: what is still open on an HTTP/1
                // connection ends now, where HAProxy saw the failure, not at its later close.
                let open: Vec<u64> = conn.backs.drain(..).collect();
                for id in open {
                    let Some(back) = self.linker.back_mut(id) else { continue };
                    back.exchange.server_closed = true;
                    let outcome = if back.exchange.response.is_some() {
                        Outcome::ClosedDuringResponse
                    } else {
                        Outcome::ClosedBeforeResponse
                    };
                    self.linker.end_backend(id, ts, outcome);
                }
            }
            Role::Frontend => {
                // A client may half-close after its request and still read the answer: a clean
                // end of stream counts only once the response is under way; a failed call always.
                for id in &conn.fronts {
                    if let Some(front) = self.linker.front_mut(*id)
                        && (front.responding || !clean)
                    {
                        front.exchange.client_closed = true;
                    }
                }
            }
            Role::Unknown | Role::Opaque => {}
        }
    }

    pub(super) fn close(&mut self, key: (u32, i32), ts: u64) {
        let Some(mut conn) = self.conns.remove(&key) else { return };
        conn.release_sampled_out(key.0, &mut self.sampled_out);
        match conn.role {
            Role::Frontend => {
                let completes_body = conn.egress.finish();
                while let Some(id) = conn.fronts.pop_front() {
                    let responding = self.linker.front(id).is_some_and(|f| f.responding);
                    let outcome = match (responding, completes_body) {
                        (true, true) => Outcome::Complete,
                        (true, false) => Outcome::ClosedDuringResponse,
                        (false, _) => Outcome::ClosedBeforeResponse,
                    };
                    self.linker.finish_front(id, ts, outcome);
                }
            }
            Role::Backend => {
                let completes_body = conn.ingress.finish();
                while let Some(id) = conn.backs.pop_front() {
                    let has_response = self.linker.back(id).is_some_and(|b| b.exchange.response.is_some());
                    let outcome = match (has_response, completes_body) {
                        (true, true) => Outcome::Complete,
                        (true, false) => Outcome::ClosedDuringResponse,
                        (false, _) => Outcome::ClosedBeforeResponse,
                    };
                    self.linker.end_backend(id, ts, outcome);
                }
            }
            Role::Unknown | Role::Opaque => {}
        }
    }
}
