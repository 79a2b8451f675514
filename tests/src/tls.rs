//! TLS material for the tests: one self-signed certificate (with its key, in the one PEM file
//! `HAProxy`'s `crt` takes), made with the `openssl` command line when first asked for.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use crate::haproxy::{self, Version};

/// The PEM file's path as `HAProxy` of `version` sees it (Debian 13 runs chrooted in its tree).
///
/// # Panics
/// When `openssl` fails (run `make setup`).
#[must_use]
pub fn certificate(version: Version) -> String {
    match version {
        Version::Debian12 => certificate_in(Path::new("/")),
        Version::Debian13 => certificate_in(&haproxy::trixie_root()),
    }
}

/// A configuration for [`crate::Stack::with_agent`]: [`haproxy::config`] with `fe_main` serving
/// TLS (HTTP/1.1 and HTTP/2 by ALPN) with [`certificate`], and two threads (the probes must follow
/// every thread of the process, not its first).
pub fn frontend(version: Version) -> impl FnOnce(u16, SocketAddr) -> String {
    let pem = certificate(version);
    move |port, backend| {
        haproxy::config(port, &[backend], "").replace("global\n", "global\n    nbthread 2\n").replace(
            &format!("bind 127.0.0.1:{port}"),
            &format!("bind 127.0.0.1:{port} ssl crt {pem} alpn h2,http/1.1"),
        )
    }
}

/// The PEM file's path as a process whose root is the tree `root` sees it (a pod's container).
///
/// # Panics
/// When `openssl` fails (run `make setup`).
#[must_use]
pub fn certificate_in(root: &Path) -> String {
    static PEM: OnceLock<Vec<u8>> = OnceLock::new();
    let pem = PEM.get_or_init(make_pem);
    let inner = format!("/tmp/tracetap-tls-{}/cert.pem", std::process::id());
    write_once(&root.join(inner.trim_start_matches('/')), pem);
    inner
}

fn write_once(path: &Path, pem: &[u8]) {
    if std::fs::read(path).is_ok_and(|existing| existing == pem) {
        return;
    }
    let dir = path.parent().expect("a directory");
    std::fs::create_dir_all(dir).expect("certificate directory");
    // Tests of one binary run in parallel: each writes its own copy, then renames it in place.
    let tmp = dir.join(format!("cert.pem.{:?}", std::thread::current().id()));
    std::fs::write(&tmp, pem).expect("write certificate");
    std::fs::rename(&tmp, path).expect("rename certificate");
}

fn make_pem() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("tracetap-tls-make-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (key, cert) = (dir.join("key.pem"), dir.join("cert.pem"));
    let status = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2"])
        .args(["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run openssl (make setup installs it)");
    assert!(status.success(), "openssl req failed");
    let mut pem = std::fs::read(&cert).expect("certificate");
    pem.extend(std::fs::read(&key).expect("key"));
    let _ = std::fs::remove_dir_all(&dir);
    pem
}
