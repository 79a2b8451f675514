//! A small blocking HTTP/1.1 client over one keep-alive connection, so tests control exactly
//! what goes on the wire (keep-alive, aborts mid-request).

use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    #[must_use]
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn connect(addr: SocketAddr) -> std::io::Result<Self> {
        let stream = TcpStream::connect(addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(15)))?;
        stream.set_nodelay(true)?;
        Ok(Self { stream, buf: Vec::new() })
    }

    /// Writes raw bytes (for partial or malformed requests).
    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends a GET with `headers` and reads the response.
    pub fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> std::io::Result<Response> {
        let mut req = format!("GET {path} HTTP/1.1\r\nHost: tracetap.test\r\nUser-Agent: tracetap-e2e\r\n");
        for (k, v) in headers {
            let _ = write!(req, "{k}: {v}\r\n");
        }
        req.push_str("\r\n");
        self.stream.write_all(req.as_bytes())?;
        self.read_response()
    }

    /// Reads one response (Content-Length or no body).
    pub fn read_response(&mut self) -> std::io::Result<Response> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(head_len) =
                resp.parse(&self.buf).map_err(|e| std::io::Error::other(format!("bad response: {e}")))?
            {
                let status = resp.code.unwrap_or(0);
                let headers: Vec<(String, String)> = resp
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect();
                let len: usize = headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
                    .and_then(|(_, v)| v.trim().parse().ok())
                    .unwrap_or(0);
                while self.buf.len() < head_len + len {
                    self.fill()?;
                }
                let body = self.buf[head_len..head_len + len].to_vec();
                self.buf.drain(..head_len + len);
                return Ok(Response { status, headers, body });
            }
            self.fill()?;
        }
    }

    fn fill(&mut self) -> std::io::Result<()> {
        let mut chunk = [0u8; 16384];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed"));
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}
