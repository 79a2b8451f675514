//! Vectored I/O (`readv`, `writev`, `recvmsg`, `sendmsg`) with the HTTP bytes spread over several
//! small buffers, from a tiny proxy written in Python under a command name of its own: the probes
//! must take every buffer of a call up to the capture window, or no head parses. Needs root.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};

use tracetap_tests::client::Conn;
use tracetap_tests::{Rig, Stack, agent, free_port, require_root};

/// Accepts `count` connections; for each, reads the request with `recvmsg_into` into buffers of
/// 7, 13 and 4096 bytes, sends it to the backend with `sendmsg` in three pieces, reads the answer
/// with `os.readv` into 9- and 4096-byte buffers until the server closes, and writes it back with
/// `os.writev` in three pieces.
const PROXY: &str = r#"
import ctypes, os, socket, sys
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)
port, backend_port, count = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("127.0.0.1", port))
ls.listen(16)
print("ready", flush=True)
for _ in range(count):
    c, _ = ls.accept()
    bufs = [bytearray(7), bytearray(13), bytearray(4096)]
    n = c.recvmsg_into(bufs)[0]
    req = bytes(b"".join(bufs))[:n]
    req = req.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    b = socket.create_connection(("127.0.0.1", backend_port))
    b.sendmsg([req[:5], req[5:20], req[20:]])
    resp = b""
    while True:
        parts = [bytearray(9), bytearray(4096)]
        got = os.readv(b.fileno(), parts)
        if got == 0:
            break
        resp += bytes(b"".join(parts))[:got]
    os.writev(c.fileno(), [resp[:3], resp[3:17], resp[17:]])
    b.close()
    c.close()
"#;

const REQUESTS: usize = 5;

#[test]
fn every_buffer_of_a_vectored_call_is_captured() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let mut proxy = Command::new("python3")
        .args(["-c", PROXY, &rig.comm, &port.to_string(), &rig.backend.addr.port().to_string(), &REQUESTS.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut ready = String::new();
    BufReader::new(proxy.stdout.take().expect("stdout")).read_line(&mut ready).expect("ready line");
    assert_eq!(ready.trim(), "ready");
    let agent = agent::Agent::start(&rig.agent_env());
    let front = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let paths: Vec<String> = (0..REQUESTS).map(|i| format!("/vectored/{i}")).collect();
    for path in &paths {
        let mut conn = Conn::connect(front).expect("connect");
        assert_eq!(conn.get(path, &[]).expect("request").status, 200);
    }
    let wanted: Vec<&str> = paths.iter().map(String::as_str).collect();
    let spans = tracetap_tests::wait_for(std::time::Duration::from_secs(20), || {
        let all = rig.receiver.spans();
        wanted.iter().all(|p| all.iter().any(|x| x.is_server() && x.str_attr("url.path") == Some(p))).then_some(all)
    })
    .unwrap_or_else(|| {
        panic!("SERVER spans missing; agent log:\n{}\nmetrics:\n{:?}", agent.log(), agent.get("/metrics"))
    });
    for path in &wanted {
        let (server, clients) = Stack::trace_of(&spans, path);
        assert_eq!(server.int_attr("http.response.status_code"), Some(200), "{path}");
        assert_eq!(
            server.str_attr("user_agent.original"),
            Some("tracetap-e2e"),
            "{path}: headers past the first buffers"
        );
        assert_eq!(clients.len(), 1, "{path}");
        assert_eq!(clients[0].int_attr("http.response.status_code"), Some(200), "{path}");
    }
    assert_eq!(agent.metric("tracetap_parse_errors_total"), 0);
    assert_eq!(agent.metric("tracetap_request_heads_truncated_total"), 0);
    let _ = proxy.kill();
    let _ = proxy.wait();
}
