//! A private certificate authority made in the test (rcgen): a server certificate for the OTLP
//! receiver (`localhost` and `127.0.0.1`) and a client certificate for mutual TLS, written as PEM
//! files where the agent's variables can name them.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

/// PEM files of one private CA and the certificates it signed.
pub struct Pki {
    pub ca_pem: String,
    pub server_cert_pem: String,
    pub server_key_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
    issuer: Issuer<'static, KeyPair>,
    dir: tempfile::TempDir,
}

/// A server certificate's shape, for the collector cases of the export tests.
#[derive(Debug, Clone, Copy)]
pub struct Leaf<'a> {
    /// subjectAltName entries: DNS names, or IP addresses when they parse as one.
    pub names: &'a [&'a str],
    /// `basicConstraints CA:TRUE`.
    pub ca: bool,
    /// Valid from the start of one year to the start of another.
    pub years: (i32, i32),
}

impl Leaf<'_> {
    /// For `localhost` and `127.0.0.1`, not a CA, valid now.
    pub const DEFAULT: Leaf<'static> = Leaf { names: &["localhost", "127.0.0.1"], ca: false, years: (2020, 2090) };

    fn params(&self) -> CertificateParams {
        let mut params =
            CertificateParams::new(self.names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).expect("params");
        params.distinguished_name.push(DnType::CommonName, self.names.first().copied().unwrap_or("collector"));
        if self.ca {
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        } else {
            params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        }
        params.not_before = rcgen::date_time_ymd(self.years.0, 1, 1);
        params.not_after = rcgen::date_time_ymd(self.years.1, 1, 1);
        params
    }

    /// Self-signed: its certificate and key, PEM.
    #[must_use]
    pub fn self_signed(&self) -> (String, String) {
        let key = KeyPair::generate().expect("key");
        (self.params().self_signed(&key).expect("self-signed certificate").pem(), key.serialize_pem())
    }
}

impl Pki {
    /// A CA named `name` and its two certificates.
    #[must_use]
    pub fn new(name: &str) -> Self {
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, name);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_key = KeyPair::generate().expect("CA key");
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca, ca_key);

        let mut server = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).expect("params");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().expect("server key");
        let server_cert = server.signed_by(&server_key, &issuer).expect("server certificate");

        let mut client = CertificateParams::new(Vec::<String>::new()).expect("params");
        client.distinguished_name.push(DnType::CommonName, "tracetap-agent");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().expect("client key");
        let client_cert = client.signed_by(&client_key, &issuer).expect("client certificate");

        let pki = Self {
            ca_pem: ca_cert.pem(),
            server_cert_pem: server_cert.pem(),
            server_key_pem: server_key.serialize_pem(),
            client_cert_pem: client_cert.pem(),
            client_key_pem: client_key.serialize_pem(),
            issuer,
            dir: tempfile::tempdir().expect("tempdir"),
        };
        for (file, pem) in
            [("ca.pem", &pki.ca_pem), ("client.pem", &pki.client_cert_pem), ("client.key", &pki.client_key_pem)]
        {
            std::fs::write(pki.dir.path().join(file), pem).expect("write PEM");
        }
        pki
    }

    /// The CA certificate, for `OTEL_EXPORTER_OTLP_CERTIFICATE`.
    #[must_use]
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The client certificate and key, for `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and `_KEY`.
    #[must_use]
    pub fn client_files(&self) -> (PathBuf, PathBuf) {
        (self.dir.path().join("client.pem"), self.dir.path().join("client.key"))
    }

    /// A server certificate of this shape signed by the CA: its certificate and key, PEM.
    #[must_use]
    pub fn leaf(&self, shape: Leaf<'_>) -> (String, String) {
        let key = KeyPair::generate().expect("key");
        (shape.params().signed_by(&key, &self.issuer).expect("certificate").pem(), key.serialize_pem())
    }

    /// Writes `pem` as `name` in [`Pki::dir`] and returns its path.
    #[must_use]
    pub fn write(&self, name: &str, pem: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, pem).expect("write PEM");
        path
    }

    /// A directory for more files of the test.
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
