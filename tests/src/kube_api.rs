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
    /// Every request's path and query.
    pub requests: Arc<Mutex<Vec<String>>>,
    kubeconfig: PathBuf,
}

impl FakeApiServer {
    /// Serves `pods` on `rt`, and writes a kubeconfig for it.
    #[must_use]
    pub fn start(rt: &tokio::runtime::Runtime, pods: &[FakePod]) -> Self {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind fake API server");
        let addr = listener.local_addr().expect("addr");
        let items: Vec<String> = pods.iter().map(FakePod::json).collect();
        let list = Arc::new(format!(
            "{{\"apiVersion\":\"v1\",\"kind\":\"PodList\",\"metadata\":{{\"resourceVersion\":\"10\"}},\"items\":[{}]}}",
            items.join(",")
        ));
        let requests: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = Arc::clone(&requests);
        rt.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let (list, seen) = (Arc::clone(&list), Arc::clone(&seen));
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                        let query = req.uri().query().unwrap_or_default().to_owned();
                        seen.lock().expect("lock").push(format!("{} {query}", req.uri().path()));
                        let body: BoxBody<Bytes, Infallible> = if query.contains("watch=true") {
                            Held.boxed()
                        } else {
                            Full::new(Bytes::from(list.to_string())).boxed()
                        };
                        async move { Ok::<_, Infallible>(Response::new(body)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let kubeconfig = std::env::temp_dir().join(format!("tracetap-kubeconfig-{}", addr.port()));
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\n\
                 users:\n- name: fake\n  user: {{}}\n"
            ),
        )
        .expect("write kubeconfig");
        Self { addr, requests, kubeconfig }
    }

    /// The kubeconfig file for `KUBECONFIG`.
    #[must_use]
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
    }
}
