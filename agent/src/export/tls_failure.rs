//! Why an export's TLS handshake failed, in the terms an operator acts on: one cause per kind of
//! fix, its label for `tracetap_export_tls_failures_total{reason}`, and one message that names
//! the variable to change and what to put in it.
//!
//! Files that cannot be read or are not PEM never get here: they stop the agent at start, naming
//! their variable (`super::tls`).

use std::error::Error as StdError;
use std::fmt::Write as _;

use rustls::{AlertDescription, CertificateError};

use super::settings::{NamedFile, TlsFiles};

/// One cause of a failed handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsFailure {
    /// The collector's certificate chains to no trusted certificate.
    UnknownIssuer,
    /// It is not valid for the endpoint's host; `presented` are the names it has.
    NameMismatch {
        expected: String,
        presented: Vec<String>,
    },
    Expired,
    NotValidYet,
    /// A CA certificate (`CA:TRUE`) presented as the collector's own, and not one the operator
    /// named (a named one is accepted: `super::verifier`).
    CaUsedAsEndEntity,
    /// The collector ended the handshake with an alert about the client's certificate: it wanted
    /// one, or did not accept ours. Other alerts are [`TlsFailure::Other`].
    HandshakeRefused(AlertDescription),
    /// Anything else rustls reports.
    Other(String),
}

/// All `reason` labels, in the order `/metrics` lists them.
pub const REASONS: [&str; 7] = [
    "unknown_issuer",
    "name_mismatch",
    "expired",
    "not_valid_yet",
    "ca_used_as_end_entity",
    "handshake_refused",
    "other",
];

/// The variables a message can point at, as the settings read them.
#[derive(Debug, Clone)]
pub struct Hints {
    /// The endpoint's variable (`OTEL_EXPORTER_OTLP_ENDPOINT` or the signal's).
    pub endpoint_var: &'static str,
    pub files: TlsFiles,
}

impl TlsFailure {
    /// Its `reason` label.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownIssuer => REASONS[0],
            Self::NameMismatch { .. } => REASONS[1],
            Self::Expired => REASONS[2],
            Self::NotValidYet => REASONS[3],
            Self::CaUsedAsEndEntity => REASONS[4],
            Self::HandshakeRefused(_) => REASONS[5],
            Self::Other(_) => REASONS[6],
        }
    }

    /// The one line the log and `/readyz` give for it.
    #[must_use]
    pub fn message(&self, hints: &Hints) -> String {
        let trust = |what: &str| match &hints.files.certificate {
            Some(NamedFile { var, path }) => format!("{what} in {var} ({})", path.display()),
            None => format!("{what} in OTEL_EXPORTER_OTLP_CERTIFICATE (unset: the system's CAs are trusted)"),
        };
        let certificate_var = hints.files.certificate.as_ref().map_or("OTEL_EXPORTER_OTLP_CERTIFICATE", |f| f.var);
        match self {
            Self::UnknownIssuer => format!(
                "the collector's certificate is not signed by {}: put there, as PEM, the CA certificate that signed it (or the collector's own certificate, if it is self-signed)",
                trust("a certificate")
            ),
            Self::NameMismatch { expected, presented } => {
                let mut names = presented.join(", ");
                if names.is_empty() {
                    names.push_str("no DNS or IP name");
                }
                format!(
                    "the collector's certificate is not valid for {expected} (it names {names}): set {} to a URL with one of its names, or reissue the certificate with {expected} in its subjectAltName",
                    hints.endpoint_var
                )
            }
            Self::Expired => "the collector's certificate has expired: renew it on the collector (tracetap trusts the new one if the same CA signed it, or if it replaces the certificate in OTEL_EXPORTER_OTLP_CERTIFICATE)".to_owned(),
            Self::NotValidYet => "the collector's certificate is not valid yet: check the clocks of this node and of the machine that issued it".to_owned(),
            Self::CaUsedAsEndEntity => format!(
                "the collector presents a CA certificate (basicConstraints CA:TRUE) as its own, which is trusted only as the very certificate {}: put that certificate there, or reissue the collector's without CA:TRUE",
                trust("named")
            ),
            Self::HandshakeRefused(alert) => {
                let mut m = format!("the collector refused the TLS handshake (alert {alert:?}): ");
                match &hints.files.client_certificate {
                    Some(NamedFile { var, path }) => {
                        let _ = write!(
                            m,
                            "it did not accept the client certificate in {var} ({}): give one signed by a CA the collector trusts",
                            path.display()
                        );
                    }
                    None => m.push_str(
                        "it wants a client certificate: set OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY to a certificate and key signed by a CA the collector trusts",
                    ),
                }
                m
            }
            Self::Other(what) => format!(
                "TLS failed ({what}): check that {} is the collector's TLS port with https://, and {certificate_var}",
                hints.endpoint_var
            ),
        }
    }
}

/// The TLS failure in an export error's chain, if the handshake is what failed.
#[must_use]
pub fn classify(error: &(dyn StdError + 'static)) -> Option<TlsFailure> {
    Some(match find_rustls_error(error)? {
        rustls::Error::InvalidCertificate(why) => match why {
            CertificateError::UnknownIssuer => TlsFailure::UnknownIssuer,
            CertificateError::NotValidForNameContext { expected, presented } => TlsFailure::NameMismatch {
                expected: expected.to_str().into_owned(),
                presented: presented.iter().map(|n| plain_name(n).to_owned()).collect(),
            },
            CertificateError::NotValidForName => {
                TlsFailure::NameMismatch { expected: "the endpoint's host".to_owned(), presented: Vec::new() }
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => TlsFailure::Expired,
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => TlsFailure::NotValidYet,
            CertificateError::Other(other)
                if other.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::CaUsedAsEndEntity) =>
            {
                TlsFailure::CaUsedAsEndEntity
            }
            other => TlsFailure::Other(format!("the collector's certificate did not verify: {other:?}")),
        },
        rustls::Error::AlertReceived(alert) if is_about_our_certificate(*alert) => TlsFailure::HandshakeRefused(*alert),
        rustls::Error::AlertReceived(AlertDescription::NoApplicationProtocol) => TlsFailure::Other(
            "the collector ended the handshake with alert NoApplicationProtocol: this port does not speak the protocol OTEL_EXPORTER_OTLP_PROTOCOL asks for (HTTP/2 for grpc)".to_owned(),
        ),
        rustls::Error::AlertReceived(alert) => {
            TlsFailure::Other(format!("the collector ended the handshake with alert {alert:?}"))
        }
        other => TlsFailure::Other(other.to_string()),
    })
}

/// Alerts a server sends about the client's certificate (missing, or not accepted).
fn is_about_our_certificate(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
    )
}

/// A presented name as webpki spells it (`DnsName("collector")`, `IpAddress(10.0.0.1)`), plain.
fn plain_name(name: &str) -> &str {
    name.split_once('(').and_then(|(_, rest)| rest.strip_suffix(')')).unwrap_or(name).trim_matches('"')
}

/// The rustls error in a chain. An `io::Error` wrapping another error reports that error's
/// *source* as its own, skipping the error itself, so wrapped errors are opened one by one.
fn find_rustls_error<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    if let Some(found) = error.downcast_ref::<rustls::Error>() {
        return Some(found);
    }
    if let Some(inner) = error.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
        return find_rustls_error(inner);
    }
    error.source().and_then(find_rustls_error)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// As hyper-rustls reports it: `io::Error::other(io::Error(InvalidData, rustls::Error))`.
    fn wrapped(e: rustls::Error) -> std::io::Error {
        std::io::Error::other(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    fn hints(certificate: bool, client: bool) -> Hints {
        let file = |var, path: &str| Some(NamedFile { var, path: path.into() });
        Hints {
            endpoint_var: "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            files: TlsFiles {
                certificate: if certificate { file("OTEL_EXPORTER_OTLP_CERTIFICATE", "/etc/ca.pem") } else { None },
                client_certificate: if client { file("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/c.pem") } else { None },
                client_key: if client { file("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/c.key") } else { None },
            },
        }
    }

    #[test]
    fn each_cause_is_found_through_wrapped_io_errors() {
        let cert = |e| wrapped(rustls::Error::InvalidCertificate(e));
        let cases = [
            (cert(CertificateError::UnknownIssuer), "unknown_issuer"),
            (
                cert(CertificateError::NotValidForNameContext {
                    expected: rustls::pki_types::ServerName::try_from("collector").unwrap(),
                    presented: vec!["localhost".into()],
                }),
                "name_mismatch",
            ),
            (cert(CertificateError::Expired), "expired"),
            (cert(CertificateError::NotValidYet), "not_valid_yet"),
            (
                cert(CertificateError::Other(rustls::OtherError(Arc::new(webpki::Error::CaUsedAsEndEntity)))),
                "ca_used_as_end_entity",
            ),
            (wrapped(rustls::Error::AlertReceived(AlertDescription::CertificateRequired)), "handshake_refused"),
            (cert(CertificateError::BadSignature), "other"),
            (wrapped(rustls::Error::AlertReceived(AlertDescription::NoApplicationProtocol)), "other"),
            (wrapped(rustls::Error::AlertReceived(AlertDescription::ProtocolVersion)), "other"),
            (wrapped(rustls::Error::AlertReceived(AlertDescription::UnknownCA)), "handshake_refused"),
        ];
        for (error, reason) in cases {
            assert_eq!(classify(&error).map(|f| f.reason()), Some(reason), "{error:?}");
        }
        assert_eq!(classify(&std::io::Error::other("connection refused")), None);
    }

    #[test]
    fn presented_names_are_given_plain() {
        assert_eq!(plain_name("DnsName(\"collector.example\")"), "collector.example");
        assert_eq!(plain_name("IpAddress(10.0.0.1)"), "10.0.0.1");
        assert_eq!(plain_name("localhost"), "localhost");
    }

    #[test]
    fn each_message_names_the_variable_to_change() {
        let name = TlsFailure::NameMismatch { expected: "collector".into(), presented: vec!["localhost".into()] };
        let m = name.message(&hints(true, false));
        assert!(
            m.contains("not valid for collector (it names localhost)")
                && m.contains("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            "{m}"
        );
        let m = TlsFailure::UnknownIssuer.message(&hints(true, false));
        assert!(m.contains("OTEL_EXPORTER_OTLP_CERTIFICATE (/etc/ca.pem)"), "{m}");
        let m = TlsFailure::UnknownIssuer.message(&hints(false, false));
        assert!(m.contains("OTEL_EXPORTER_OTLP_CERTIFICATE (unset"), "{m}");
        let m = TlsFailure::CaUsedAsEndEntity.message(&hints(true, false));
        assert!(m.contains("CA:TRUE") && m.contains("OTEL_EXPORTER_OTLP_CERTIFICATE"), "{m}");
        let refused = TlsFailure::HandshakeRefused(AlertDescription::CertificateRequired);
        assert!(refused.message(&hints(true, false)).contains("set OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and"));
        assert!(
            refused
                .message(&hints(true, true))
                .contains("did not accept the client certificate in OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE (/c.pem)")
        );
        for failure in [TlsFailure::Expired, TlsFailure::NotValidYet, TlsFailure::Other("x".into())] {
            assert!(!failure.message(&hints(true, true)).is_empty());
        }
    }

    #[test]
    fn every_reason_is_listed() {
        let all = [
            TlsFailure::UnknownIssuer,
            TlsFailure::NameMismatch { expected: String::new(), presented: Vec::new() },
            TlsFailure::Expired,
            TlsFailure::NotValidYet,
            TlsFailure::CaUsedAsEndEntity,
            TlsFailure::HandshakeRefused(AlertDescription::BadCertificate),
            TlsFailure::Other(String::new()),
        ];
        assert_eq!(all.map(|f| f.reason()), REASONS);
    }
}
