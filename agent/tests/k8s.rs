//! The pod watch against a fake API server: a list, then a watch that ends (the API server's watch
//! timeout, or a broken connection), a watch that fails with 500, and a watch that resumes from the
//! last resource version with a change and a deletion. Responses are recorded JSON in the API
//! server's wire format.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tracetap::k8s::{self, PodIndex};
use tracetap::metrics::Metrics;

fn pod(name: &str, uid: &str, version: &str, tier: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ingress",
            "uid": uid,
            "resourceVersion": version,
            "labels": {"app": "edge", "tier": tier, "pod-template-hash": "5f6d"},
            "annotations": {"tracetap.dev/service-name": format!("svc-{name}")},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "edge-5f6d", "uid": "rs-1", "controller": true
            }]
        },
        "spec": {"nodeName": "node-a", "containers": [{"name": "haproxy", "image": "haproxy:2.6"}]}
    })
}

fn event(kind: &str, object: &serde_json::Value) -> String {
    format!("{}\n", serde_json::json!({"type": kind, "object": object}))
}

/// The fake API server's script, and what it was asked.
#[derive(Default)]
struct ApiServer {
    watches: usize,
    queries: Vec<String>,
}

fn answer(state: &Mutex<ApiServer>, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or_default().to_owned();
    let mut s = state.lock().unwrap();
    s.queries.push(format!("{} {}", req.uri().path(), query));
    let ok = |body: String| Response::new(Full::new(Bytes::from(body)));
    if req.uri().path() != "/api/v1/pods" {
        return Response::builder().status(StatusCode::NOT_FOUND).body(Full::new(Bytes::new())).unwrap();
    }
    if !query.contains("watch=true") {
        let list = serde_json::json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "100"},
            "items": [pod("edge-1", "uid-1", "90", "front"), pod("edge-2", "uid-2", "95", "front")]
        });
        return ok(list.to_string());
    }
    s.watches += 1;
    match s.watches {
        // A pod is added, then the watch ends.
        1 => ok(event("ADDED", &pod("edge-3", "uid-3", "101", "front"))),
        // The API server fails once.
        2 => Response::builder().status(StatusCode::INTERNAL_SERVER_ERROR).body(Full::new(Bytes::from("{}"))).unwrap(),
        // Resumed: one pod changes its labels, one is deleted.
        3 => ok(event("MODIFIED", &pod("edge-1", "uid-1", "102", "back"))
            + &event("DELETED", &pod("edge-2", "uid-2", "103", "front"))),
        _ => ok(String::new()),
    }
}

async fn serve(state: Arc<Mutex<ApiServer>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let response = answer(&state, &req);
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn follows_this_nodes_pods_through_broken_watches() {
    let state = Arc::new(Mutex::new(ApiServer::default()));
    let addr = serve(Arc::clone(&state)).await;
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let client = kube::Client::try_from(config).unwrap();
    let index = PodIndex::default();
    let metrics = Arc::new(Metrics::default());
    let watch = tokio::spawn(k8s::watch(client, "node-a".into(), Arc::clone(&index), Arc::clone(&metrics)));

    let snapshot = |index: &PodIndex| -> HashMap<String, String> {
        index.read().unwrap().iter().map(|(uid, pod)| (uid.clone(), pod.labels["tier"].clone())).collect()
    };
    let want = HashMap::from([("uid-1".to_owned(), "back".to_owned()), ("uid-3".to_owned(), "front".to_owned())]);
    let mut settled = false;
    for _ in 0..200 {
        if snapshot(&index) == want {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queries = state.lock().unwrap().queries.clone();
    assert!(settled, "index {:?}; API server was asked:\n{}", snapshot(&index), queries.join("\n"));
    watch.abort();

    let pod = index.read().unwrap()["uid-1"].clone();
    assert_eq!((pod.name.as_str(), pod.namespace.as_str()), ("edge-1", "ingress"));
    assert_eq!(pod.owner, Some(("Deployment".to_owned(), "edge".to_owned())));
    assert_eq!(pod.service_name.as_deref(), Some("svc-edge-1"));
    assert!(
        queries.iter().all(|q| q.contains("fieldSelector=spec.nodeName%3Dnode-a")),
        "every request is limited to this node: {queries:?}"
    );
    assert!(
        queries.iter().any(|q| q.contains("watch=true") && q.contains("resourceVersion=101")),
        "resumed: {queries:?}"
    );
    assert!(metrics.k8s_api_errors.load(Relaxed) >= 1, "the failed watch is counted");
    assert_eq!(metrics.k8s_pods.load(Relaxed), 2);
}
