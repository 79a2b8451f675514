//! Kubernetes metadata: the container and pod of a traced `HAProxy` from its cgroup, the node from
//! `NODE_NAME`, and pod names, owners and labels from the API server (a fake one that lists pods,
//! found through `KUBECONFIG`). The tests put real `HAProxy` processes into cgroups named as the
//! kubelet and containerd name them (systemd driver), so they need root and a cgroup v2 hierarchy.

use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::container::PodCgroup;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::kube_api::{FakeApiServer, FakePod};
use tracetap_tests::{Rig, free_port, require_root, wait_for};

const POD_UID: &str = "7d3f1c2a-5b6e-4f70-9a8b-1c2d3e4f5a6b";
const CONTAINER_ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// HAProxy `pid` moved into the pod cgroup of `pod_uid` and `container_id`.
fn pod_cgroup(pid: u32, pod_uid: &str, container_id: &str) -> PodCgroup {
    let cgroup = PodCgroup::create(pod_uid, container_id);
    cgroup.enter(pid);
    cgroup
}

#[test]
fn resource_names_the_container_pod_and_node_of_haproxy() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let proxy = Haproxy::start(&rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
    let cgroup = pod_cgroup(proxy.pid(), POD_UID, CONTAINER_ID);
    let cgroup_line = std::fs::read_to_string(format!("/proc/{}/cgroup", proxy.pid())).expect("cgroup");
    assert!(cgroup_line.contains(CONTAINER_ID), "HAProxy is in the container cgroup: {cgroup_line}");

    let mut env = rig.agent_env();
    env.push(("NODE_NAME", "node-under-test".to_owned()));
    let agent = Agent::start(&env);
    let mut conn = Conn::connect(format!("127.0.0.1:{port}").parse().expect("addr")).expect("connect");
    assert_eq!(conn.get("/k8s", &[]).expect("request").status, 200);
    let spans = rig.receiver.wait_for_spans(2);
    assert_eq!(spans.len(), 2, "agent log:\n{}", agent.log());
    for span in &spans {
        assert_eq!(span.resource_str("container.id"), Some(CONTAINER_ID));
        assert_eq!(span.resource_str("k8s.pod.uid"), Some(POD_UID));
        assert_eq!(span.resource_str("k8s.node.name"), Some("node-under-test"));
    }
    let unified = cgroup_line.lines().find(|l| l.starts_with("0::")).unwrap_or_default();
    println!("[kubernetes] HAProxy in cgroup {unified}: its spans carry container.id, k8s.pod.uid and k8s.node.name");
    drop(agent);
    drop(proxy);
    drop(cgroup);
}

#[test]
fn pods_from_the_api_server_name_spans_and_the_selector_picks_pods() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let edge_uid = "11111111-2222-4333-8444-555555555555";
    let internal_uid = "66666666-7777-4888-9999-aaaaaaaaaaaa";
    let api = FakeApiServer::start(
        &rig.rt,
        &[
            FakePod {
                name: "edge-5f6d-x1".into(),
                uid: edge_uid.into(),
                labels: vec![("tier".into(), "edge".into())],
                deployment: "edge".into(),
            },
            FakePod {
                name: "internal-5f6d-y2".into(),
                uid: internal_uid.into(),
                labels: vec![("tier".into(), "internal".into())],
                deployment: "internal".into(),
            },
        ],
    );
    let (edge_port, internal_port) = (free_port(), free_port());
    let edge = Haproxy::start(&rig.comm, &haproxy::config(edge_port, &[rig.backend.addr], ""), edge_port);
    let internal = Haproxy::start_in(
        &rig.comm,
        "internal",
        &haproxy::config(internal_port, &[rig.backend.addr], ""),
        internal_port,
    );
    let _edge_cgroup = pod_cgroup(edge.pid(), edge_uid, &"e".repeat(64));
    let _internal_cgroup = pod_cgroup(internal.pid(), internal_uid, &"f".repeat(64));

    let mut env = rig.agent_env();
    env.push(("NODE_NAME", "node-a".to_owned()));
    env.push(("KUBECONFIG", api.kubeconfig().display().to_string()));
    env.push(("TRACETAP_K8S_POD_SELECTOR", "tier=edge".to_owned()));
    let agent = Agent::start(&env);
    let one_left_out =
        wait_for(Duration::from_secs(10), || (agent.metric("tracetap_k8s_targets_not_selected") == 1).then_some(()));
    assert!(one_left_out.is_some(), "the internal pod is not selected; agent log:\n{}", agent.log());

    for (port, path) in [(edge_port, "/edge"), (internal_port, "/internal")] {
        let mut conn = Conn::connect(format!("127.0.0.1:{port}").parse().expect("addr")).expect("connect");
        assert_eq!(conn.get(path, &[]).expect("request").status, 200);
    }
    let spans = rig.receiver.wait_for_spans(2);
    std::thread::sleep(Duration::from_millis(500));
    let spans = if spans.len() > 2 { spans } else { rig.receiver.spans() };
    assert!(
        spans.iter().all(|s| s.str_attr("url.path") != Some("/internal")),
        "the pod outside the selector is not traced"
    );
    assert_eq!(spans.len(), 2, "SERVER and CLIENT span of /edge; agent log:\n{}", agent.log());
    for span in &spans {
        assert_eq!(span.resource_str("k8s.pod.name"), Some("edge-5f6d-x1"));
        assert_eq!(span.resource_str("k8s.namespace.name"), Some("edge"));
        assert_eq!(span.resource_str("k8s.deployment.name"), Some("edge"));
        assert_eq!(span.resource_str("k8s.pod.uid"), Some(edge_uid));
        assert_eq!(span.service, "edge", "service.name from the owning Deployment");
    }
    let requests = api.requests.lock().expect("lock").clone();
    assert!(requests.iter().all(|r| r.contains("fieldSelector=spec.nodeName%3Dnode-a")), "{requests:?}");
    assert_eq!(agent.metric("tracetap_k8s_pods"), 2);
    println!(
        "[kubernetes] pods from the API server: spans of the selected pod named, the other pod untraced; API requests: {}",
        requests.len()
    );
}

/// A cluster configuration that is there but unusable is reported with its reason, not taken for
/// "outside Kubernetes".
#[test]
fn an_unusable_kubeconfig_is_reported_with_its_reason() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, "clusters: [this is not a kubeconfig\n").expect("write");
    let mut env = rig.agent_env();
    env.push(("NODE_NAME", "node-a".to_owned()));
    env.push(("KUBECONFIG", kubeconfig.display().to_string()));
    let agent = Agent::start_without_targets(&env);
    let reported = wait_for(Duration::from_secs(10), || agent.log().contains("is unusable").then_some(()));
    let log = agent.log();
    assert!(reported.is_some(), "the unusable configuration is reported; log:\n{log}");
    let line = log.lines().find(|l| l.contains("is unusable")).expect("the line");
    assert!(line.contains("kubeconfig"), "with kube's reason: {line}");
    assert!(!log.contains("no Kubernetes cluster configuration"), "not taken for outside Kubernetes");
    println!("[kubernetes] unusable KUBECONFIG: {line}");
}
