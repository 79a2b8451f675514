//! Kubernetes pod metadata for the traced `HAProxy` processes.
//!
//! A process's pod UID comes from its cgroup (`tracetap_proxy::cgroup`, no API needed); the pod's
//! name, namespace, labels and owner come from a watch of the pods on this node
//! (`spec.nodeName=$NODE_NAME`) on the API server, kept in a [`PodIndex`] by UID. The watch runs
//! only when `NODE_NAME` is set and a cluster configuration can be found (in-cluster service
//! account, or `KUBECONFIG`); otherwise everything here is off, silently. A broken watch is
//! retried with backoff (kube-runtime's watcher resumes from the last resource version, or relists),
//! and shows in `/metrics`; meanwhile spans keep their cgroup-derived ids.

pub mod selector;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};

use crate::metrics::{self, Metrics};

/// The annotation that names a pod's `service.name`.
pub const SERVICE_NAME_ANNOTATION: &str = "tracetap.dev/service-name";

/// What the agent knows of a pod.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodMeta {
    pub name: String,
    pub namespace: String,
    pub labels: BTreeMap<String, String>,
    /// `tracetap.dev/service-name`, when set.
    pub service_name: Option<String>,
    /// The workload that owns the pod: (`Deployment` | `DaemonSet` | `StatefulSet` | `ReplicaSet` |
    /// `Job` | ..., name).
    pub owner: Option<(String, String)>,
}

impl PodMeta {
    /// Reads a pod object.
    #[must_use]
    pub fn from_pod(pod: &Pod) -> Self {
        let meta = &pod.metadata;
        let labels: BTreeMap<String, String> = meta.labels.clone().unwrap_or_default();
        let controller = meta.owner_references.iter().flatten().find(|o| o.controller == Some(true));
        let owner = controller.map(|o| {
            // A Deployment's pods are owned by a ReplicaSet named `<deployment>-<pod-template-hash>`;
            // the hash is also a pod label, so the Deployment is found without another API call.
            match (o.kind.as_str(), labels.get("pod-template-hash")) {
                ("ReplicaSet", Some(hash)) => match o.name.strip_suffix(&format!("-{hash}")) {
                    Some(deployment) => ("Deployment".to_owned(), deployment.to_owned()),
                    None => ("ReplicaSet".to_owned(), o.name.clone()),
                },
                (kind, _) => (kind.to_owned(), o.name.clone()),
            }
        });
        Self {
            name: meta.name.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            service_name: meta.annotations.as_ref().and_then(|a| a.get(SERVICE_NAME_ANNOTATION).cloned()),
            labels,
            owner,
        }
    }

    /// Resource attributes per the OpenTelemetry Kubernetes conventions, and `service.name`: the
    /// annotation, else the owner's name, else `default_service`.
    #[must_use]
    pub fn attributes(&self, default_service: &str) -> Vec<(String, String)> {
        let mut attrs = vec![
            ("k8s.pod.name".to_owned(), self.name.clone()),
            ("k8s.namespace.name".to_owned(), self.namespace.clone()),
        ];
        if let Some((kind, name)) = &self.owner {
            let key = match kind.as_str() {
                "Deployment" => Some("k8s.deployment.name"),
                "DaemonSet" => Some("k8s.daemonset.name"),
                "StatefulSet" => Some("k8s.statefulset.name"),
                "ReplicaSet" => Some("k8s.replicaset.name"),
                "Job" => Some("k8s.job.name"),
                _ => None,
            };
            if let Some(key) = key {
                attrs.push((key.to_owned(), name.clone()));
            }
        }
        let service = self
            .service_name
            .clone()
            .or_else(|| self.owner.as_ref().map(|(_, name)| name.clone()))
            .unwrap_or_else(|| default_service.to_owned());
        attrs.push(("service.name".to_owned(), service));
        attrs
    }
}

/// Pods of this node by UID, shared between the watch (writer) and the capture thread (reader).
pub type PodIndex = Arc<RwLock<HashMap<String, PodMeta>>>;

/// Watches the pods of `node` into `index` until the task is dropped; errors are counted and the
/// watch retried with backoff.
pub async fn watch(client: kube::Client, node: String, index: PodIndex, metrics: Arc<Metrics>) {
    let pods: kube::Api<Pod> = kube::Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut stream = Box::pin(watcher::watcher(pods, config).default_backoff());
    let mut relisted: HashMap<String, PodMeta> = HashMap::new();
    let mut last_warning: Option<std::time::Instant> = None;
    while let Some(event) = stream.next().await {
        let uid = |pod: &Pod| pod.metadata.uid.clone().unwrap_or_default();
        match event {
            Ok(Event::Init) => relisted.clear(),
            Ok(Event::InitApply(pod)) => {
                relisted.insert(uid(&pod), PodMeta::from_pod(&pod));
            }
            Ok(Event::InitDone) => {
                metrics::set(&metrics.k8s_api_up, 1);
                let mut index = index.write().expect("pod index lock");
                *index = std::mem::take(&mut relisted);
                metrics::set(&metrics.k8s_pods, index.len() as u64);
            }
            Ok(Event::Apply(pod)) => {
                let mut index = index.write().expect("pod index lock");
                index.insert(uid(&pod), PodMeta::from_pod(&pod));
                metrics::set(&metrics.k8s_pods, index.len() as u64);
            }
            Ok(Event::Delete(pod)) => {
                let mut index = index.write().expect("pod index lock");
                index.remove(&uid(&pod));
                metrics::set(&metrics.k8s_pods, index.len() as u64);
            }
            Err(e) => {
                metrics::set(&metrics.k8s_api_up, 0);
                metrics::add(&metrics.k8s_api_errors, 1);
                if last_warning.is_none_or(|t| t.elapsed().as_secs() >= 60) {
                    tracing::warn!(error = %e, "pod watch failed; retrying with backoff (spans keep cgroup-derived ids)");
                    last_warning = Some(std::time::Instant::now());
                }
            }
        }
    }
}

/// A client for the cluster this agent runs in, when there is one: in-cluster service account, or
/// `KUBECONFIG`. `Ok(None)` outside Kubernetes (neither is configured); an error when one is
/// configured but unusable (a kubeconfig that does not parse, a missing token), so that the
/// operator learns why pods go unnamed.
pub async fn client() -> Result<Option<kube::Client>, String> {
    let configured = std::env::var_os("KUBECONFIG").is_some() || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let config = match kube::Config::infer().await {
        Ok(config) => config,
        Err(e) if configured => return Err(e.to_string()),
        Err(_) => return Ok(None),
    };
    kube::Client::try_from(config).map(Some).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    use super::*;

    fn pod(owner_kind: &str, owner: &str, hash: Option<&str>, annotation: Option<&str>) -> Pod {
        let mut labels = BTreeMap::from([("app".to_owned(), "edge".to_owned())]);
        if let Some(h) = hash {
            labels.insert("pod-template-hash".into(), h.into());
        }
        Pod {
            metadata: ObjectMeta {
                name: Some("edge-7d9f-abcde".into()),
                namespace: Some("ingress".into()),
                uid: Some("u1".into()),
                labels: Some(labels),
                annotations: annotation.map(|a| BTreeMap::from([(SERVICE_NAME_ANNOTATION.to_owned(), a.to_owned())])),
                owner_references: Some(vec![OwnerReference {
                    kind: owner_kind.into(),
                    name: owner.into(),
                    controller: Some(true),
                    ..OwnerReference::default()
                }]),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn attr<'a>(attrs: &'a [(String, String)], key: &str) -> Option<&'a str> {
        attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    #[test]
    fn deployment_is_found_through_the_replicaset_name() {
        let meta = PodMeta::from_pod(&pod("ReplicaSet", "edge-7d9f", Some("7d9f"), None));
        assert_eq!(meta.owner, Some(("Deployment".into(), "edge".into())));
        let attrs = meta.attributes("haproxy");
        assert_eq!(attr(&attrs, "k8s.deployment.name"), Some("edge"));
        assert_eq!(attr(&attrs, "k8s.pod.name"), Some("edge-7d9f-abcde"));
        assert_eq!(attr(&attrs, "k8s.namespace.name"), Some("ingress"));
        assert_eq!(attr(&attrs, "service.name"), Some("edge"), "the owner names the service");
    }

    #[test]
    fn annotation_wins_and_other_owners_keep_their_kind() {
        let meta = PodMeta::from_pod(&pod("DaemonSet", "edge-ds", None, Some("checkout-edge")));
        let attrs = meta.attributes("haproxy");
        assert_eq!(attr(&attrs, "k8s.daemonset.name"), Some("edge-ds"));
        assert_eq!(attr(&attrs, "service.name"), Some("checkout-edge"));
        let bare = PodMeta { name: "p".into(), namespace: "n".into(), ..PodMeta::default() };
        assert_eq!(attr(&bare.attributes("haproxy"), "service.name"), Some("haproxy"));
        let odd = PodMeta::from_pod(&pod("ReplicaSet", "edge-other", Some("7d9f"), None));
        assert_eq!(odd.owner, Some(("ReplicaSet".into(), "edge-other".into())));
    }
}
