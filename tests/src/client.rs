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

    /// The socket itself, for reading an answer to the end (`read_to_end`).
    #[must_use]
    pub fn into_stream(self) -> TcpStream {
        self.stream
    }

    /// The connection's local port: the `network.peer.port` of its SERVER spans.
    pub fn local_port(&self) -> std::io::Result<u16> {
        Ok(self.stream.local_addr()?.port())
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

    /// Reads one response: Content-Length, chunked, or (without either) until the server closes.
    /// A 1xx interim response is returned as it is; read again for the final one.
    pub fn read_response(&mut self) -> std::io::Result<Response> {
        let (status, headers, head_len) = loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut resp = httparse::Response::new(&mut headers);
            if let httparse::Status::Complete(head_len) =
                resp.parse(&self.buf).map_err(|e| std::io::Error::other(format!("bad response: {e}")))?
            {
                let headers: Vec<(String, String)> = resp
                    .headers
                    .iter()
                    .map(|h| (h.name.to_owned(), String::from_utf8_lossy(h.value).into_owned()))
                    .collect();
                break (resp.code.unwrap_or(0), headers, head_len);
            }
            self.fill()?;
        };
        self.buf.drain(..head_len);
        let response = Response { status, headers, body: Vec::new() };
        let body = if (100..200).contains(&status) || status == 204 || status == 304 {
            Vec::new()
        } else if let Some(len) = response.header("content-length").and_then(|v| v.trim().parse::<usize>().ok()) {
            self.take(len)?
        } else if response.header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            self.take_chunked()?
        } else {
            while self.fill().is_ok() {}
            std::mem::take(&mut self.buf)
        };
        Ok(Response { body, ..response })
    }

    /// Reads exactly `len` raw bytes (tunnelled data after an upgrade).
    pub fn read_exact_bytes(&mut self, len: usize) -> std::io::Result<Vec<u8>> {
        self.take(len)
    }

    fn take(&mut self, len: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < len {
            self.fill()?;
        }
        Ok(self.buf.drain(..len).collect())
    }

    fn take_line(&mut self) -> std::io::Result<String> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                self.buf.drain(..end + 2);
                return Ok(line);
            }
            self.fill()?;
        }
    }

    fn take_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line = self.take_line()?;
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|e| std::io::Error::other(format!("bad chunk size {line:?}: {e}")))?;
            if size == 0 {
                while !self.take_line()?.is_empty() {}
                return Ok(body);
            }
            body.extend(self.take(size)?);
            self.take_line()?;
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
