//! A fake Kubernetes API server for the agent's pod watch: it lists the pods it was given (as the
//! API server's `PodList` JSON) and holds every watch open without events, and a kubeconfig that
//! points at it (the agent finds it through `KUBECONFIG`, as `kubectl` would).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Frame};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

/// A pod as the fake lists it.
#[derive(Debug, Clone)]
pub struct FakePod {
    pub name: String,
    pub uid: String,
    pub labels: Vec<(String, String)>,
    /// The Deployment that owns the pod (through a `ReplicaSet` named `<deployment>-5f6d`).
    pub deployment: String,
}

impl FakePod {
    fn json(&self) -> String {
        let labels: Vec<String> = self
            .labels
            .iter()
            .chain(std::iter::once(&("pod-template-hash".to_owned(), "5f6d".to_owned())))
            .map(|(k, v)| format!("\"{k}\":\"{v}\""))
            .collect();
        format!(
            concat!(
                "{{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{{\"name\":\"{name}\",\"namespace\":\"edge\",",
                "\"uid\":\"{uid}\",\"resourceVersion\":\"10\",\"labels\":{{{labels}}},\"ownerReferences\":[{{",
                "\"apiVersion\":\"apps/v1\",\"kind\":\"ReplicaSet\",\"name\":\"{deployment}-5f6d\",\"uid\":\"rs\",",
                "\"controller\":true}}]}},\"spec\":{{\"nodeName\":\"node-a\",\"containers\":[{{\"name\":\"haproxy\"}}]}}}}"
            ),
            name = self.name,
            uid = self.uid,
            labels = labels.join(","),
            deployment = self.deployment,
        )
    }
}

/// A body that never ends: a watch with nothing to report.
struct Held;

impl Body for Held {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Pending
    }
}

pub struct FakeApiServer {
    pub addr: SocketAddr,
    /// Every request's path and query (with ` bearer` appended when it carried the service
    /// account's token).
    pub requests: Arc<Mutex<Vec<String>>>,
    kubeconfig: PathBuf,
    /// In-cluster: the CA and the service account's files, as the kubelet mounts them.
    in_cluster: Option<InCluster>,
}

/// What a pod of the cluster is given to reach the API server.
struct InCluster {
    _pki: crate::pki::Pki,
    service_account: tempfile::TempDir,
}

/// The token the fake's service account has.
const TOKEN: &str = "tracetap-test-token";

impl FakeApiServer {
    /// Serves `pods` on `rt` over plain HTTP, and writes a kubeconfig for it.
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime, pods: &[FakePod]) -> Self {
        Self::serve(rt, pods, None)
    }

    /// Serves `pods` on `rt` as a cluster's API server is reached from a pod: HTTPS with a
    /// certificate of the cluster's CA for `127.0.0.1`, and a service account directory
    /// ([`FakeApiServer::service_account_dir`]: `token`, `ca.crt`, `namespace`) to mount at
    /// `/var/run/secrets/kubernetes.io/serviceaccount`, found through
    /// [`FakeApiServer::in_cluster_env`].
    #[must_use]
    pub fn start_in_cluster(rt: &tokio::runtime::Runtime, pods: &[FakePod]) -> Self {
        let pki = crate::pki::Pki::new("fake-cluster-ca");
        let service_account = tempfile::tempdir().expect("service account dir");
        for (file, content) in [("token", TOKEN), ("ca.crt", pki.ca_pem.as_str()), ("namespace", "tracetap")] {
            std::fs::write(service_account.path().join(file), content).expect("service account file");
        }
        let tls = crate::otlp::ServerTls {
            cert_pem: pki.server_cert_pem.clone(),
            key_pem: pki.server_key_pem.clone(),
            client_ca_pem: None,
        };
        let acceptor = crate::otlp::tls_acceptor(&tls, false);
        let mut server = Self::serve(rt, pods, Some(acceptor));
        server.in_cluster = Some(InCluster { _pki: pki, service_account });
        server
    }

    /// In-cluster: the directory the kubelet would mount at
    /// `/var/run/secrets/kubernetes.io/serviceaccount`.
    #[must_use]
    pub fn service_account_dir(&self) -> &Path {
        self.in_cluster.as_ref().expect("started in-cluster").service_account.path()
    }

    /// In-cluster: the variables the kubelet sets in every container for the `kubernetes` service.
    #[must_use]
    pub fn in_cluster_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("KUBERNETES_SERVICE_HOST", self.addr.ip().to_string()),
            ("KUBERNETES_SERVICE_PORT", self.addr.port().to_string()),
        ]
    }

    fn serve(rt: &tokio::runtime::Runtime, pods: &[FakePod], tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind fake API server");
        let addr = listener.local_addr().expect("addr");
        let items: Vec<String> = pods.iter().map(FakePod::json).collect();
        let list = Arc::new(format!(
            "{{\"apiVersion\":\"v1\",\"kind\":\"PodList\",\"metadata\":{{\"resourceVersion\":\"10\"}},\"items\":[{}]}}",
            items.join(",")
        ));
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = Arc::clone(&requests);
        let scheme = if tls.is_some() { "https" } else { "http" };
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (list, seen, tls) = (Arc::clone(&list), Arc::clone(&seen), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => answer(stream, list, seen).await,
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                answer(stream, list, seen).await;
                            }
                        }
                    }
                });
            }
        });
        let kubeconfig = std::env::temp_dir().join(format!("tracetap-kubeconfig-{}", addr.port()));
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {scheme}://{addr}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\n\
                 users:\n- name: fake\n  user: {{}}\n"
            ),
        )
        .expect("write kubeconfig");
        Self { addr, requests, kubeconfig, in_cluster: None }
    }

    /// The kubeconfig file for `KUBECONFIG`.
    #[must_use]
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }
}

/// Answers one connection's requests: the pod list, or a watch held open without events.
async fn answer<S>(stream: S, list: Arc<String>, seen: Arc<Mutex<Vec<String>>>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let query = req.uri().query().unwrap_or_default().to_owned();
        let bearer =
            req.headers().get("authorization").is_some_and(|v| v.as_bytes() == format!("Bearer {TOKEN}").as_bytes());
        seen.lock().expect("lock").push(format!("{} {query}{}", req.uri().path(), if bearer { " bearer" } else { "" }));
        let body: BoxBody<Bytes, Infallible> =
            if query.contains("watch=true") { Held.boxed() } else { Full::new(Bytes::from(list.to_string())).boxed() };
        async move { Ok::<_, Infallible>(Response::new(body)) }
    });
    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}
