//! TLS for OTLP exports: the roots to trust (the CA file the operator names, else the system's,
//! else the webpki roots compiled in) and the client certificate for mutual TLS, read once at
//! start so that a bad file stops the agent there, naming its variable.
//!
//! The certificates the variable names are trusted as roots, and as the collector's own even when
//! marked as a CA (`super::verifier`). At run time a certificate that does not verify is not a
//! crash: the exporter counts it by cause and logs one clear line per cause (`super::tls_failure`).

use std::sync::Arc;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use super::settings::{NamedFile, TlsFiles};
use super::verifier::CollectorVerifier;
use crate::config_error::ConfigError;

/// Certificate and key files are small; a larger one is not what the variable should name.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The connector of the agent's HTTP/1.1 clients (OTLP/HTTP): TLS for `https` URIs with `config`.
#[must_use]
pub fn http1_connector(config: ClientConfig) -> HttpsConnector<HttpConnector> {
    hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http1().build()
}

/// The connector of the agent's HTTP/2 clients (OTLP/gRPC); ALPN `h2` for `https` URIs.
#[must_use]
pub fn http2_connector(config: ClientConfig) -> HttpsConnector<HttpConnector> {
    hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http2().build()
}

/// A configuration for a connector that never makes TLS connections (an `http://` endpoint): no
/// roots to load.
#[must_use]
pub fn plaintext_config() -> ClientConfig {
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth()
}

/// Builds the client TLS configuration.
pub fn client_config(files: &TlsFiles) -> Result<ClientConfig, ConfigError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    let builder = match &files.certificate {
        Some(file) => {
            let named = read_certificates(file)?;
            let mut roots = RootCertStore::empty();
            for cert in &named {
                roots.add(cert.clone()).map_err(|e| bad(file, format!("a CA certificate rustls accepts: {e}")))?;
            }
            let verifier = CollectorVerifier::new(named, roots, provider)
                .map_err(|e| bad(file, format!("certificates rustls can verify with: {e}")))?;
            builder.dangerous().with_custom_certificate_verifier(Arc::new(verifier))
        }
        None => builder.with_root_certificates(system_roots()),
    };
    let config = match (&files.client_certificate, &files.client_key) {
        (Some(cert_file), Some(key_file)) => {
            let chain = read_certificates(cert_file)?;
            let key = PrivateKeyDer::from_pem_slice(&read_file(key_file)?)
                .map_err(|e| bad(key_file, format!("a PEM private key (PKCS#8, PKCS#1 or SEC1): {e}")))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| bad(key_file, format!("the private key of the client certificate: {e}")))?
        }
        // The settings parser refuses one without the other.
        _ => builder.with_no_client_auth(),
    };
    // ALPN stays empty: the connector sets it from the HTTP versions it enables.
    Ok(config)
}

/// The system's CA certificates (as `SSL_CERT_FILE`/`SSL_CERT_DIR` or the distribution's bundle
/// give them), or the webpki roots when the system has none (a minimal container image).
fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for error in &native.errors {
        // A wrong SSL_CERT_FILE or SSL_CERT_DIR, most likely: say so before the first handshake fails.
        tracing::warn!(%error, "reading the system's CA certificates");
    }
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    if added == 0 {
        tracing::info!("no system CA certificates found: trusting the webpki roots built into tracetap");
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    roots
}

fn read_file(file: &NamedFile) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(&file.path)
        .and_then(|f| f.take(MAX_PEM_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| bad(file, format!("a readable PEM file: {e}")))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(bad(file, format!("a PEM file of at most {MAX_PEM_BYTES} bytes")));
    }
    Ok(bytes)
}

fn read_certificates(file: &NamedFile) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bytes = read_file(file)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(file, format!("PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad(file, "a PEM file with at least one CERTIFICATE block"));
    }
    Ok(certs)
}

fn bad(file: &NamedFile, expected: impl Into<String>) -> ConfigError {
    ConfigError::new(file.var, &file.path.display().to_string(), expected)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_ca_file_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            Some(NamedFile { var: "OTEL_EXPORTER_OTLP_CERTIFICATE", path })
        };
        let empty = TlsFiles { certificate: file("empty.pem", ""), ..TlsFiles::default() };
        assert_eq!(client_config(&empty).unwrap_err().var, "OTEL_EXPORTER_OTLP_CERTIFICATE");
        let garbage = TlsFiles {
            certificate: file("bad.pem", "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n"),
            ..TlsFiles::default()
        };
        assert!(client_config(&garbage).is_err());
        let missing = TlsFiles {
            certificate: Some(NamedFile { var: "OTEL_EXPORTER_OTLP_CERTIFICATE", path: dir.path().join("none") }),
            ..TlsFiles::default()
        };
        assert!(client_config(&missing).unwrap_err().expected.contains("readable"));
    }
}
