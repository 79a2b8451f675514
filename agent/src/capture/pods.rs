//! Where each target process runs, for its resource attributes and for the pod selector: the
//! container and pod ids from its cgroup (read once per process), and, when the pod watch runs,
//! the pod's name, namespace, owner and labels from the shared [`PodIndex`].

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use tracetap_proxy::cgroup;

use crate::batch::Batcher;
use crate::k8s::PodIndex;
use crate::k8s::selector::LabelSelector;

#[derive(Debug, Clone, Default)]
struct Cgroup {
    /// `container.id`, `k8s.pod.uid`.
    attributes: Vec<(String, String)>,
    pod_uid: Option<String>,
}

#[derive(Debug)]
pub struct Pods {
    proc_root: PathBuf,
    index: Option<PodIndex>,
    selector: Option<LabelSelector>,
    default_service: String,
    cgroups: HashMap<u32, Cgroup>,
    /// The attributes last handed to the batcher, per traced process.
    applied: HashMap<u32, Vec<(String, String)>>,
}

impl Pods {
    #[must_use]
    pub fn new(
        proc_root: PathBuf,
        index: Option<PodIndex>,
        selector: Option<LabelSelector>,
        default_service: String,
    ) -> Self {
        Self { proc_root, index, selector, default_service, cgroups: HashMap::new(), applied: HashMap::new() }
    }

    fn cgroup(&mut self, pid: u32) -> &Cgroup {
        let root = &self.proc_root;
        self.cgroups.entry(pid).or_insert_with(|| {
            let Ok(text) = std::fs::read_to_string(root.join(pid.to_string()).join("cgroup")) else {
                return Cgroup::default();
            };
            let ids = cgroup::parse(&text);
            let mut attributes = Vec::new();
            if let Some(id) = &ids.container_id {
                attributes.push(("container.id".to_owned(), id.clone()));
            }
            if let Some(uid) = &ids.pod_uid {
                attributes.push(("k8s.pod.uid".to_owned(), uid.clone()));
            }
            Cgroup { attributes, pod_uid: ids.pod_uid }
        })
    }

    /// True when the process may be traced: always without a selector; with one, only when its pod
    /// is known and its labels match.
    pub fn selected(&mut self, pid: u32) -> bool {
        if self.selector.is_none() {
            return true;
        }
        let Some(uid) = self.cgroup(pid).pod_uid.clone() else { return false };
        let (Some(index), Some(selector)) = (&self.index, &self.selector) else { return false };
        index.read().expect("pod index lock").get(&uid).is_some_and(|pod| selector.matches(&pod.labels))
    }

    /// Hands every target's current resource attributes to the batcher when they changed (the
    /// pod watch may learn a pod after its process is traced).
    pub fn refresh(&mut self, targets: &BTreeSet<u32>, batcher: &mut Batcher) {
        for &pid in targets {
            let cgroup = self.cgroup(pid).clone();
            let mut attributes = cgroup.attributes;
            if let (Some(index), Some(uid)) = (&self.index, &cgroup.pod_uid)
                && let Some(pod) = index.read().expect("pod index lock").get(uid)
            {
                attributes.extend(pod.attributes(&self.default_service));
            }
            if self.applied.get(&pid) != Some(&attributes) {
                batcher.set_process_attributes(pid, attributes.clone());
                self.applied.insert(pid, attributes);
            }
        }
    }

    /// Forgets what is cached of processes that are no longer candidates.
    pub fn keep_only(&mut self, candidates: &BTreeSet<u32>) {
        self.cgroups.retain(|pid, _| candidates.contains(pid));
    }

    /// Forgets a process that exited (or is no longer a candidate).
    pub fn forget(&mut self, pid: u32) {
        self.cgroups.remove(&pid);
        self.applied.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::{Arc, RwLock};

    use super::*;
    use crate::k8s::PodMeta;

    const UID: &str = "2b1a6f0e-3c4d-4e5f-8a9b-0c1d2e3f4a5b";

    fn proc_with_pod(pid: u32) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(pid.to_string());
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), format!("0::/kubepods/burstable/pod{UID}/{}\n", "a".repeat(64))).unwrap();
        root
    }

    fn index(labels: &[(&str, &str)]) -> PodIndex {
        let meta = PodMeta {
            name: "edge-1".into(),
            namespace: "ingress".into(),
            labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect::<BTreeMap<_, _>>(),
            service_name: None,
            owner: Some(("Deployment".into(), "edge".into())),
        };
        Arc::new(RwLock::new(HashMap::from([(UID.to_owned(), meta)])))
    }

    #[test]
    fn selector_needs_a_known_matching_pod() {
        let root = proc_with_pod(7);
        let select = |labels: &[(&str, &str)], selector: &str| {
            let selector = Some(LabelSelector::parse(selector).unwrap());
            Pods::new(root.path().into(), Some(index(labels)), selector, "haproxy".into()).selected(7)
        };
        assert!(select(&[("app", "edge")], "app=edge"));
        assert!(!select(&[("app", "other")], "app=edge"));
        let unknown =
            Pods::new(root.path().into(), Some(index(&[])), Some(LabelSelector::parse("x").unwrap()), "h".into())
                .selected(8);
        assert!(!unknown, "a process without a pod is not selected");
        assert!(Pods::new(root.path().into(), None, None, "h".into()).selected(8), "no selector: everything");
    }

    #[test]
    fn attributes_join_cgroup_ids_and_pod_metadata() {
        let root = proc_with_pod(7);
        let mut pods = Pods::new(root.path().into(), Some(index(&[])), None, "haproxy".into());
        let mut batcher = Batcher::new(8, std::time::Duration::from_secs(1), Vec::new());
        pods.refresh(&BTreeSet::from([7]), &mut batcher);
        let applied = &pods.applied[&7];
        let keys: Vec<&str> = applied.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "container.id",
                "k8s.pod.uid",
                "k8s.pod.name",
                "k8s.namespace.name",
                "k8s.deployment.name",
                "service.name"
            ]
        );
    }
}
