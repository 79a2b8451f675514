//! Per connection state: numbering (every record of a numbered connection carries the next
//! sequence number, taken before delivery, so a lost record leaves a gap the agent sees), the
//! agent's opaque marks (reported without payload), TLS (its ciphertext is not reported) and
//! HTTP/2 (copied whole), and what a read or write on a socket gets ([`plan_data`]).

use aya_ebpf::{
    helpers::bpf_probe_read_user,
    macros::map,
    maps::{Array, HashMap, LruHashMap},
};
use tracetap_ebpf_common::{MAX_NUMBERED_CONNECTIONS, STAGING_BYTES, plaintext::starts_like_http};

use crate::{CAPTURE_BYTES, tls};

/// Per connection (`tgid << 32 | fd`) seen opened by `accept`/`connect`: when it was opened (its
/// identity, see [`OPAQUE_CONNS`]) and the sequence number of its last record. Numbering happens
/// before delivery, so a record the ring had no room for leaves a gap the agent sees. LRU:
/// connections whose close we never saw (process exit) age out.
#[map]
pub(crate) static CONNS: LruHashMap<u64, ConnState> = LruHashMap::with_max_entries(MAX_NUMBERED_CONNECTIONS, 0);

#[repr(C)]
pub(crate) struct ConnState {
    /// `ts_ns` of the connection's `accept`/`connect` record.
    pub(crate) opened_ns: u64,
    seq: u32,
    /// The `OPAQUE_GENERATION` at which `opaque` was last looked up (0: never).
    checked_generation: u32,
    /// Whether `OPAQUE_CONNS` marked this connection, as of `checked_generation`.
    opaque: u32,
    /// `CONN_*` bits.
    pub(crate) flags: u32,
    /// With `CONN_TLS`: the `SSL *` bound to this connection (see the `tls` module), forgotten
    /// with the connection.
    pub(crate) ssl: u64,
}

/// The connection carries TLS: its socket bytes are ciphertext and not reported; the plaintext
/// comes from the TLS library probes (see the `tls` module).
pub(crate) const CONN_TLS: u32 = 1;
/// The agent was told that the connection carries TLS (its `TlsOpen` record was sent).
pub(crate) const CONN_TLS_ANNOUNCED: u32 = 2;
/// The connection speaks HTTP/2 (its bytes began with the client preface): every byte of its
/// frame headers and header blocks is needed to keep the HPACK state, so its records are copied
/// up to the staging buffer's size whatever the capture window says.
pub(crate) const CONN_H2: u32 = 4;
/// The first record with payload was seen, and `CONN_H2` and `CONN_CLEARTEXT` decided from its
/// first bytes.
pub(crate) const CONN_DECIDED: u32 = 8;
/// The connection came from `accept`: a frontend, whose request heads may be dropped at once
/// (see the `head` module).
pub(crate) const CONN_ACCEPTED: u32 = 16;
/// The first record with payload, not bound to a TLS call (`tls::bind` said no), started like
/// HTTP (`plaintext::starts_like_http`): the socket carries HTTP in the clear, and no TLS
/// handshake starts on it later (`HAProxy` upgrades no connection to TLS), so `tls::bind` is not
/// asked again: it costs a hash lookup on every record.
pub(crate) const CONN_CLEARTEXT: u32 = 32;

/// Connections whose bytes the agent does not want (they do not speak HTTP/1: TLS, `mode tcp`,
/// tunnels), as `tgid << 32 | fd` to the `ts_ns` of their `accept`/`connect` record. Only the
/// agent writes it, and it never holds more than the map's size (a plain hash map, so nothing is
/// evicted behind the agent's back). A read or write on such a connection is still reported,
/// for its size and sequence number, but without payload. The opening time makes a mark that
/// arrives after the connection closed and its fd was reused (the agent lags the probes) match
/// nothing.
#[map]
pub(crate) static OPAQUE_CONNS: HashMap<u64, u64> = HashMap::with_max_entries(MAX_NUMBERED_CONNECTIONS, 0);

/// 0 while `OPAQUE_CONNS` is empty; otherwise a number the agent changes after every mark it
/// adds. A connection looks the map up only when this differs from what it last saw, so that
/// reads and writes pay no hash lookup in steady state, even while some long-lived connection
/// (a resolver's socket, a WebSocket) stays marked. An array lookup the JIT inlines.
#[map]
pub(crate) static OPAQUE_GENERATION: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
pub(crate) fn conn_key(tgid: u32, fd: i32) -> u64 {
    (u64::from(tgid) << 32) | u64::from(fd as u32)
}

/// Starts numbering a new connection's records (with these `CONN_*` flags); its first record
/// carries 1.
#[inline(always)]
pub(crate) fn open_conn(tgid: u32, fd: i32, opened_ns: u64, flags: u32) -> u32 {
    let state = ConnState { opened_ns, seq: 1, checked_generation: 0, opaque: 0, flags, ssl: 0 };
    // A full table evicts the least recently used entry; insert fails only on memory pressure.
    u32::from(CONNS.insert(conn_key(tgid, fd), &state, 0).is_ok())
}

/// Takes the next sequence number of a numbered connection (see `CONNS`).
#[inline(always)]
pub(crate) fn take_seq(state: *mut ConnState) -> u32 {
    // SAFETY: map value pointer; a racing update from another thread on the same fd can only
    // make the agent see a gap that was not one, never hide one.
    unsafe {
        let seq = (*state).seq.wrapping_add(1);
        (*state).seq = seq;
        seq
    }
}

/// The next sequence number of a connection's records (0 for connections not numbered).
#[inline(always)]
pub(crate) fn next_seq(tgid: u32, fd: i32) -> u32 {
    CONNS.get_ptr_mut(conn_key(tgid, fd)).map_or(0, take_seq)
}

/// What a read or write on a socket gets: nothing (the bytes are TLS ciphertext, whose plaintext
/// the TLS probes report), a header without payload (the agent marked the connection opaque), or
/// a copy of up to `window` bytes (on a connection with these `CONN_*` flags).
#[derive(Copy, Clone)]
pub(crate) enum DataPlan {
    Skip,
    HeaderOnly { seq: u32 },
    Copy { seq: u32, window: u64, flags: u32 },
}

/// The plan for a read or write of `ret` bytes at `buf` (its first bytes decide `CONN_H2`, see
/// [`decide_h2`]).
#[inline(always)]
pub(crate) fn plan_data(pid_tgid: u64, tgid: u32, fd: i32, plain_buf: Option<u64>, ret: i64) -> DataPlan {
    let key = conn_key(tgid, fd);
    let Some(state) = CONNS.get_ptr_mut(key) else {
        return DataPlan::Copy { seq: 0, window: capture_window(0), flags: 0 };
    };
    // SAFETY: map value pointer, see `take_seq`.
    let flags = unsafe { (*state).flags };
    if flags & CONN_TLS != 0 || (flags & CONN_CLEARTEXT == 0 && tls::bind(pid_tgid, tgid, fd, state)) {
        return DataPlan::Skip;
    }
    let seq = take_seq(state);
    if payload_unwanted(key, state) {
        DataPlan::HeaderOnly { seq }
    } else {
        let flags = decide_h2(state, plain_buf, ret);
        DataPlan::Copy { seq, window: capture_window(flags), flags }
    }
}

/// [`payload_unwanted`] for a connection known by its `tgid` and `fd`.
#[inline(always)]
pub(crate) fn payload_unwanted_at(tgid: u32, fd: i32, state: *mut ConnState) -> bool {
    payload_unwanted(conn_key(tgid, fd), state)
}

/// How many bytes of a record to copy on a connection with these `CONN_*` flags.
#[inline(always)]
pub(crate) fn capture_window(flags: u32) -> u64 {
    if flags & CONN_H2 != 0 {
        return STAGING_BYTES as u64;
    }
    // SAFETY: the agent writes this global before load.
    u64::from(unsafe { core::ptr::read_volatile(&raw const CAPTURE_BYTES) })
}

/// The HTTP/2 client preface starts with these bytes (`PRI `, little endian); no HTTP/1 request
/// does.
pub(crate) const H2_PREFACE_START: u32 = u32::from_le_bytes(*b"PRI ");

/// On a connection's first record with payload (`ret` bytes at `buf`, a plain buffer; `None`
/// for vectored calls, which `HAProxy` does not start connections with), decides `CONN_H2` from
/// its first bytes: one 4-byte read per connection, before the window of that very record is
/// chosen, so that the preface's flight is copied whole too; and `CONN_CLEARTEXT` on a connection
/// not bound to TLS whose first bytes start like HTTP (`plaintext::starts_like_http`). Returns
/// the connection's flags.
#[inline(always)]
pub(crate) fn decide_h2(state: *mut ConnState, buf: Option<u64>, ret: i64) -> u32 {
    // SAFETY: map value pointer, see `take_seq`.
    let flags = unsafe { (*state).flags };
    if flags & CONN_DECIDED != 0 || ret <= 0 {
        return flags;
    }
    let mut decided = flags | CONN_DECIDED;
    if ret >= 4
        && let Some(buf) = buf
        // SAFETY: a helper read of user memory, which faults safely.
        && let Ok(first) = unsafe { bpf_probe_read_user(buf as *const u32) }
    {
        if first == H2_PREFACE_START {
            decided |= CONN_H2;
        }
        if flags & CONN_TLS == 0 && starts_like_http(first) {
            decided |= CONN_CLEARTEXT;
        }
    }
    // SAFETY: as above.
    unsafe { (*state).flags = decided };
    decided
}

#[inline(always)]
pub(crate) fn payload_unwanted(key: u64, state: *mut ConnState) -> bool {
    let generation = OPAQUE_GENERATION.get(0).map_or(0, |g| *g);
    if generation == 0 {
        return false;
    }
    // SAFETY: map value pointer, see `take_seq`; a stale cache only costs a lookup or a copy.
    unsafe {
        if (*state).checked_generation != generation {
            // SAFETY: read-only lookup of a plain value.
            let marked = OPAQUE_CONNS.get(key).is_some_and(|opened| *opened == (*state).opened_ns);
            (*state).opaque = u32::from(marked);
            (*state).checked_generation = generation;
        }
        (*state).opaque != 0
    }
}

/// Drops the agent's opaque mark of a connection the TLS probes just bound: the mark came from its
/// handshake's ciphertext (see `tls::bind`), and its plaintext is wanted from the first record.
/// Should the connection be opaque for another reason, the agent marks it again.
#[inline(always)]
pub(crate) fn drop_opaque_mark(tgid: u32, fd: i32, state: *mut ConnState) {
    if payload_unwanted_at(tgid, fd, state) {
        let _ = OPAQUE_CONNS.remove(conn_key(tgid, fd));
        // SAFETY: map value pointer, see `take_seq`; the cached verdict follows the map.
        unsafe { (*state).opaque = 0 };
    }
}
