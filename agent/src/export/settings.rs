//! The exporter's own settings, parsed from the standard `OTEL_EXPORTER_OTLP_*` variables: a pure
//! parse of a key/value source, like the rest of the configuration. The signal-specific variable
//! (`OTEL_EXPORTER_OTLP_TRACES_HEADERS`) wins over the general one (`OTEL_EXPORTER_OTLP_HEADERS`),
//! and errors name whichever was read.
//!
//! Certificate files are named here and read by [`super::tls`] at start, so that a missing or bad
//! file is an exit at start too, naming its variable.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::config_error::ConfigError;

/// Which telemetry an exporter sends: the signal-specific variables and the base URL's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Traces,
    Metrics,
}

/// The variable names of one signal, or the general ones.
struct Vars {
    endpoint: &'static str,
    protocol: &'static str,
    headers: &'static str,
    timeout: &'static str,
    compression: &'static str,
    certificate: &'static str,
    client_certificate: &'static str,
    client_key: &'static str,
}

const GENERAL: Vars = Vars {
    endpoint: "OTEL_EXPORTER_OTLP_ENDPOINT",
    protocol: "OTEL_EXPORTER_OTLP_PROTOCOL",
    headers: "OTEL_EXPORTER_OTLP_HEADERS",
    timeout: "OTEL_EXPORTER_OTLP_TIMEOUT",
    compression: "OTEL_EXPORTER_OTLP_COMPRESSION",
    certificate: "OTEL_EXPORTER_OTLP_CERTIFICATE",
    client_certificate: "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    client_key: "OTEL_EXPORTER_OTLP_CLIENT_KEY",
};

const TRACES: Vars = Vars {
    endpoint: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    protocol: "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    headers: "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    timeout: "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    compression: "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    certificate: "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    client_certificate: "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
    client_key: "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
};

const METRICS: Vars = Vars {
    endpoint: "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    protocol: "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    headers: "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    timeout: "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT",
    compression: "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION",
    certificate: "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
    client_certificate: "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
    client_key: "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
};

impl Signal {
    fn vars(self) -> &'static Vars {
        match self {
            Self::Traces => &TRACES,
            Self::Metrics => &METRICS,
        }
    }

    /// The path OTLP/HTTP appends to a base URL.
    fn http_path(self) -> &'static str {
        match self {
            Self::Traces => "/v1/traces",
            Self::Metrics => "/v1/metrics",
        }
    }

    /// The gRPC method, `/package.Service/Method`.
    #[must_use]
    pub fn grpc_path(self) -> &'static str {
        match self {
            Self::Traces => "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            Self::Metrics => "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export",
        }
    }
}

/// `OTEL_EXPORTER_OTLP_PROTOCOL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// POSTs of protobuf bodies (port 4318 by convention).
    HttpProtobuf,
    /// The `Export` method of the OTLP gRPC services (port 4317 by convention).
    Grpc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
}

/// A parsed `http://` or `https://` endpoint URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The variable that named it, for messages.
    pub var: &'static str,
    /// `https`: the connection is TLS.
    pub tls: bool,
    /// `host:port`, as dialled (the port made explicit).
    pub authority: String,
    /// Path and query, starting with `/` (`/` for gRPC, whose path is the method's).
    pub path: String,
}

impl Endpoint {
    /// The URL requests go to.
    #[must_use]
    pub fn uri(&self) -> hyper::Uri {
        self.to_string().parse().expect("checked when parsed")
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority, self.path)
    }
}

/// A certificate or key file and the variable that named it (for errors when it is read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedFile {
    pub var: &'static str,
    pub path: PathBuf,
}

/// What TLS uses besides the system's roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificates to trust instead of the system's roots.
    pub certificate: Option<NamedFile>,
    /// PEM client certificate chain and its key, for mutual TLS (both or neither).
    pub client_certificate: Option<NamedFile>,
    pub client_key: Option<NamedFile>,
}

/// Everything one OTLP exporter needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportSettings {
    /// `None`: no endpoint configured.
    pub endpoint: Option<Endpoint>,
    pub protocol: Protocol,
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    pub compression: Compression,
    pub tls: TlsFiles,
}

impl ExportSettings {
    /// The configured headers as HTTP headers (checked when the settings were parsed).
    #[must_use]
    pub fn header_map(&self) -> hyper::HeaderMap {
        let mut headers = hyper::HeaderMap::new();
        for (name, value) in &self.headers {
            let name = hyper::header::HeaderName::from_bytes(name.as_bytes()).expect("checked header name");
            headers.append(name, hyper::header::HeaderValue::from_str(value).expect("checked header value"));
        }
        headers
    }
}

/// The conventional port of OTLP/gRPC, for an `http://` gRPC URL that gives none (a collector's
/// plaintext gRPC listener). An `https://` URL without a port means 443, as any client reads it: a
/// vendor's gRPC endpoint behind TLS.
const GRPC_PORT: u16 = 4317;

/// Parses one signal's export settings.
pub fn parse(signal: Signal, get: &dyn Fn(&str) -> Option<String>) -> Result<ExportSettings, ConfigError> {
    // Empty values mean unset, as the OpenTelemetry specification asks.
    let read = |var: &'static str| get(var).filter(|v| !v.trim().is_empty()).map(|v| (var, v));
    let pick = |specific: &'static str, general: &'static str| read(specific).or_else(|| read(general));
    let vars = signal.vars();

    let protocol = match pick(vars.protocol, GENERAL.protocol) {
        None => Protocol::HttpProtobuf,
        Some((var, v)) => match v.trim() {
            "http/protobuf" => Protocol::HttpProtobuf,
            "grpc" => Protocol::Grpc,
            _ => return Err(ConfigError::new(var, &v, "http/protobuf or grpc (http/json is not supported)")),
        },
    };
    let endpoint = match (read(vars.endpoint), read(GENERAL.endpoint)) {
        (Some((var, url)), _) => Some(parse_endpoint(var, &url, protocol, None)?),
        (None, Some((var, url))) => Some(parse_endpoint(var, &url, protocol, Some(signal.http_path()))?),
        (None, None) => None,
    };
    let headers = match pick(vars.headers, GENERAL.headers) {
        Some((var, v)) => parse_headers(var, &v)?,
        None => Vec::new(),
    };
    let timeout = match pick(vars.timeout, GENERAL.timeout) {
        None => Duration::from_secs(10),
        Some((var, v)) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms),
            _ => return Err(ConfigError::new(var, &v, "a positive whole number of milliseconds")),
        },
    };
    let compression = match pick(vars.compression, GENERAL.compression) {
        None => Compression::None,
        Some((var, v)) => match v.trim() {
            "none" => Compression::None,
            "gzip" => Compression::Gzip,
            _ => return Err(ConfigError::new(var, &v, "none or gzip")),
        },
    };
    let file = |specific, general| pick(specific, general).map(|(var, v)| NamedFile { var, path: v.trim().into() });
    let tls = TlsFiles {
        certificate: file(vars.certificate, GENERAL.certificate),
        client_certificate: file(vars.client_certificate, GENERAL.client_certificate),
        client_key: file(vars.client_key, GENERAL.client_key),
    };
    match (&tls.client_certificate, &tls.client_key) {
        (Some(cert), None) => {
            return Err(ConfigError::new(
                cert.var,
                &cert.path.display().to_string(),
                format!("a client certificate needs its key too ({} or {})", vars.client_key, GENERAL.client_key),
            ));
        }
        (None, Some(key)) => {
            return Err(ConfigError::new(
                key.var,
                &key.path.display().to_string(),
                format!(
                    "a client key needs its certificate too ({} or {})",
                    vars.client_certificate, GENERAL.client_certificate
                ),
            ));
        }
        _ => {}
    }
    Ok(ExportSettings { endpoint, protocol, headers, timeout, compression, tls })
}

/// An endpoint URL. `base_path` is the signal's path, appended when the URL is the general base
/// URL of OTLP/HTTP; gRPC takes no path (the method is its path).
fn parse_endpoint(
    var: &'static str,
    url: &str,
    protocol: Protocol,
    base_path: Option<&str>,
) -> Result<Endpoint, ConfigError> {
    let url = url.trim();
    let expected = "an http:// or https:// URL such as http://collector:4318";
    let uri: hyper::Uri = url.parse().map_err(|e| ConfigError::new(var, url, format!("{expected}: {e}")))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(ConfigError::new(var, url, expected)),
    };
    let Some(authority) = uri.authority() else { return Err(ConfigError::new(var, url, expected)) };
    if authority.as_str().contains('@') || authority.host().is_empty() {
        return Err(ConfigError::new(var, url, format!("{expected}, without user information")));
    }
    // What follows the host's last `:` (an IPv6 literal's colons are inside its brackets).
    let text = authority.as_str();
    let written_port = text.rsplit_once(':').filter(|_| !text.ends_with(']')).map(|(_, p)| p);
    let port = match written_port {
        Some(p) => match p.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => return Err(ConfigError::new(var, url, format!("{expected}: a port from 1 to 65535"))),
        },
        None if tls => 443,
        None if protocol == Protocol::Grpc => GRPC_PORT,
        None => 80,
    };
    let path = uri.path_and_query().map_or("", |p| p.as_str());
    let path = match (protocol, base_path) {
        (Protocol::Grpc, _) if path.is_empty() || path == "/" => "/".to_owned(),
        (Protocol::Grpc, _) => {
            return Err(ConfigError::new(var, url, "a gRPC endpoint without a path, such as http://collector:4317"));
        }
        (Protocol::HttpProtobuf, Some(signal_path)) => format!("{}{signal_path}", path.trim_end_matches('/')),
        (Protocol::HttpProtobuf, None) if path.is_empty() => "/".to_owned(),
        (Protocol::HttpProtobuf, None) => path.to_owned(),
    };
    let endpoint = Endpoint { var, tls, authority: format!("{}:{port}", authority.host()), path };
    // Built again from its parts, as the exporter will: anything HTTP does not take is refused here.
    endpoint.to_string().parse::<hyper::Uri>().map_err(|e| ConfigError::new(var, url, format!("{expected}: {e}")))?;
    Ok(endpoint)
}

/// Headers the exporter writes itself or that belong to the connection: one set by the operator
/// too would contradict them and fail every export.
const RESERVED_HEADERS: &[&str] =
    &["content-type", "content-length", "content-encoding", "transfer-encoding", "host", "connection", "te", "upgrade"];

/// Export headers: `key=value` pairs, each a valid HTTP header name and value (checked with the
/// `http` types the exporter uses, so a header that passes here is sent), none of them one the
/// exporter or the connection owns.
fn parse_headers(var: &'static str, text: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let pairs = parse_pairs(var, text)?;
    for (name, value) in &pairs {
        let Ok(header) = hyper::header::HeaderName::from_bytes(name.as_bytes()) else {
            return Err(ConfigError::new(var, text, format!("HTTP header names; `{name}` is not one")));
        };
        if RESERVED_HEADERS.contains(&header.as_str()) || header.as_str().starts_with("grpc-") {
            return Err(ConfigError::new(
                var,
                text,
                format!("headers other than those the exporter sets itself; `{name}` is one of them"),
            ));
        }
        if hyper::header::HeaderValue::from_str(value).is_err() {
            return Err(ConfigError::new(
                var,
                text,
                format!("HTTP header values; the value of `{name}` is not one (a control character?)"),
            ));
        }
    }
    Ok(pairs)
}

/// Parses the W3C-baggage-like `key=value,key2=value2` lists of the `OTel` variables (values
/// percent-decoded).
pub fn parse_pairs(var: &'static str, text: &str) -> Result<Vec<(String, String)>, ConfigError> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = item.split_once('=').ok_or_else(|| {
            ConfigError::new(var, text, format!("key=value pairs separated by commas; `{item}` has no `=`"))
        })?;
        let k = k.trim();
        if k.is_empty() {
            return Err(ConfigError::new(var, text, "key=value pairs separated by commas; a key is empty"));
        }
        let v = percent_decode(v.trim())
            .ok_or_else(|| ConfigError::new(var, text, format!("valid percent-encoding in the value of `{k}`")))?;
        out.push((k.to_owned(), v));
    }
    Ok(out)
}

/// Percent-decoding as the `percent-encoding` crate does it (a `%` not followed by two hex digits
/// stays as written); the result must be UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s).decode_utf8().ok().map(std::borrow::Cow::into_owned)
}
