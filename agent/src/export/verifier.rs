//! The check of the collector's certificate when `OTEL_EXPORTER_OTLP_CERTIFICATE` names the
//! certificates to trust: webpki's, as rustls does it, with one rule relaxed the way the
//! OpenTelemetry Collector, the Go SDK (`crypto/x509`) and the Python SDK (OpenSSL) relax it.
//!
//! `openssl req -x509` makes a self-signed certificate marked as a CA (`basicConstraints
//! CA:TRUE`), and operators hand that very file to the collector as its certificate and to the
//! agent as the one to trust. webpki refuses a CA certificate presented as a server's own
//! (`CaUsedAsEndEntity`); Go and OpenSSL accept a certificate the client was told to trust as it
//! is. So does this verifier, and only then:
//!
//! - **relaxed**: `CA:TRUE` on the certificate the server presents, when that certificate is, byte
//!   for byte, one of those the variable names;
//! - **relaxed with it**: its extended key usage, which webpki checks after the CA rule (Go would
//!   refuse such a certificate whose extended key usage leaves out server authentication);
//! - **kept**: its validity period (webpki checks it before the CA rule: an expired one is
//!   refused as expired), the server name (checked here as webpki checks it after the chain), and
//!   the handshake's signature by the certificate's key (webpki's, unchanged).
//!
//! Everything else is webpki's answer as it is.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

/// webpki's verifier, and the certificates the operator named, whose own `CA:TRUE` is accepted.
#[derive(Debug)]
pub struct CollectorVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    named: Vec<CertificateDer<'static>>,
}

impl CollectorVerifier {
    /// Trusts `named` (the certificates of the variable's file) as roots, and as themselves.
    ///
    /// # Errors
    /// When rustls cannot make a verifier of these roots (none of them is usable).
    pub fn new(
        named: Vec<CertificateDer<'static>>,
        roots: RootCertStore,
        provider: Arc<CryptoProvider>,
    ) -> Result<Self, rustls::client::VerifierBuilderError> {
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider).build()?;
        Ok(Self { webpki, named })
    }

    fn is_named(&self, end_entity: &CertificateDer<'_>) -> bool {
        self.named.iter().any(|c| c.as_ref() == end_entity.as_ref())
    }
}

/// webpki's refusal of a CA certificate as a server's own (rustls reports it as an "other" error).
fn is_ca_used_as_end_entity(error: &rustls::Error) -> bool {
    matches!(
        error,
        rustls::Error::InvalidCertificate(CertificateError::Other(other))
            if other.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::CaUsedAsEndEntity)
    )
}

impl ServerCertVerifier for CollectorVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(e) if is_ca_used_as_end_entity(&e) && self.is_named(end_entity) => {
                rustls::client::verify_server_name(&ParsedCertificate::try_from(end_entity)?, server_name)?;
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

    use super::*;

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    const NOW: (i32, i32) = (2020, 2090);
    const PAST: (i32, i32) = (2020, 2021);
    const FUTURE: (i32, i32) = (2090, 2091);

    /// A self-signed certificate for `names`, a CA or not, valid from the start of one year to
    /// the start of another.
    fn self_signed(names: &[&str], ca: bool, (from, to): (i32, i32)) -> CertificateDer<'static> {
        let mut params = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        if ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        }
        params.not_before = rcgen::date_time_ymd(from, 1, 1);
        params.not_after = rcgen::date_time_ymd(to, 1, 1);
        params.self_signed(&KeyPair::generate().unwrap()).unwrap().der().clone()
    }

    fn verifier_trusting(certs: &[&CertificateDer<'static>]) -> CollectorVerifier {
        let mut roots = RootCertStore::empty();
        for c in certs {
            roots.add((*c).clone()).unwrap();
        }
        CollectorVerifier::new(certs.iter().map(|c| (*c).clone()).collect(), roots, provider()).unwrap()
    }

    fn verify(
        v: &CollectorVerifier,
        cert: &CertificateDer<'_>,
        name: &str,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from(name.to_owned()).unwrap();
        v.verify_server_cert(cert, &[], &name, &[], UnixTime::now())
    }

    #[test]
    fn a_named_ca_certificate_is_accepted_as_the_servers_own_for_its_names() {
        let cert = self_signed(&["localhost", "127.0.0.1"], true, NOW);
        let v = verifier_trusting(&[&cert]);
        assert!(verify(&v, &cert, "localhost").is_ok());
        assert!(verify(&v, &cert, "127.0.0.1").is_ok());
        // webpki alone refuses it: the rule this verifier relaxes.
        let err =
            v.webpki.verify_server_cert(&cert, &[], &ServerName::try_from("localhost").unwrap(), &[], UnixTime::now());
        assert!(is_ca_used_as_end_entity(&err.unwrap_err()));
    }

    #[test]
    fn the_name_check_stays_on() {
        let cert = self_signed(&["localhost"], true, NOW);
        let v = verifier_trusting(&[&cert]);
        let err = verify(&v, &cert, "collector.example").unwrap_err();
        assert!(
            matches!(err, rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. })),
            "{err:?}"
        );
    }

    #[test]
    fn the_validity_period_stays_on() {
        let expired = self_signed(&["localhost"], true, PAST);
        let err = verify(&verifier_trusting(&[&expired]), &expired, "localhost").unwrap_err();
        assert!(matches!(err, rustls::Error::InvalidCertificate(CertificateError::ExpiredContext { .. })), "{err:?}");
        let future = self_signed(&["localhost"], true, FUTURE);
        let err = verify(&verifier_trusting(&[&future]), &future, "localhost").unwrap_err();
        assert!(
            matches!(err, rustls::Error::InvalidCertificate(CertificateError::NotValidYetContext { .. })),
            "{err:?}"
        );
    }

    #[test]
    fn a_ca_certificate_not_named_is_still_refused() {
        // Trusted through a root of the same name and key would be another certificate: here the
        // server presents a CA certificate the operator did not name.
        let named = self_signed(&["localhost"], true, NOW);
        let other = self_signed(&["localhost"], true, NOW);
        let err = verify(&verifier_trusting(&[&named]), &other, "localhost").unwrap_err();
        assert!(!matches!(err, rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. })));
        assert!(matches!(err, rustls::Error::InvalidCertificate(_)), "{err:?}");
    }

    #[test]
    fn a_self_signed_leaf_is_accepted_by_webpki_itself() {
        let leaf = self_signed(&["localhost"], false, NOW);
        assert!(verify(&verifier_trusting(&[&leaf]), &leaf, "localhost").is_ok());
    }
}
