//! Kubernetes metadata that the agent derives on its own: the container and pod of a traced
//! `HAProxy` from its cgroup, and the node from `NODE_NAME`. The test puts a real `HAProxy` into a
//! cgroup named as the kubelet and containerd name them (systemd driver), so it needs root and a
//! cgroup v2 hierarchy.

use std::path::PathBuf;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::haproxy::{self, Haproxy};
use tracetap_tests::{Rig, free_port, require_root};

const POD_UID: &str = "7d3f1c2a-5b6e-4f70-9a8b-1c2d3e4f5a6b";
const CONTAINER_ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/// Where cgroup v2 is mounted (`/sys/fs/cgroup` or, on hybrid hosts, `/sys/fs/cgroup/unified`).
fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
    mounts
        .lines()
        .find_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .expect("a cgroup v2 hierarchy is mounted")
}

/// A pod-and-container cgroup holding a process; removed (the process moved back out) on drop.
struct PodCgroup {
    root: PathBuf,
    dirs: Vec<PathBuf>,
    pid: u32,
}

impl PodCgroup {
    fn enter(pid: u32) -> Self {
        let root = cgroup2_root();
        let pod_slice = format!("kubepods-burstable-pod{}.slice", POD_UID.replace('-', "_"));
        let rel =
            ["kubepods.slice", "kubepods-burstable.slice", &pod_slice, &format!("cri-containerd-{CONTAINER_ID}.scope")];
        let mut dirs = Vec::new();
        let mut dir = root.clone();
        for part in rel {
            dir.push(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
                dirs.push(dir.clone());
            }
        }
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).expect("moving HAProxy into the pod cgroup");
        Self { root, dirs, pid }
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.root.join("cgroup.procs"), self.pid.to_string());
        for dir in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[test]
fn resource_names_the_container_pod_and_node_of_haproxy() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let proxy = Haproxy::start(&rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
    let cgroup = PodCgroup::enter(proxy.pid());
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
