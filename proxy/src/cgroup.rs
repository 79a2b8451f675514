//! Which container and Kubernetes pod a process runs in, from its `/proc/PID/cgroup`.
//!
//! The kubelet names a pod's cgroup after the pod's UID and the runtime names the container's
//! cgroup after the container ID, in shapes that depend on the cgroup version (v1: one line per
//! controller; v2: one `0::` line), the cgroup driver (systemd: `kubepods-burstable-pod<uid with
//! underscores>.slice`, `cri-containerd-<id>.scope`; cgroupfs: `pod<uid>/<id>`) and the runtime
//! (containerd `cri-containerd-`, CRI-O `crio-`, Docker `docker-`). The file is read from another
//! process, so it is parsed as untrusted text: anything that does not match yields nothing.

/// The ids found in a process's cgroup path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupIds {
    /// The pod UID, `8-4-4-4-12` lower-case hex with dashes.
    pub pod_uid: Option<String>,
    /// The 64-hex-digit container ID.
    pub container_id: Option<String>,
}

/// Parses the contents of `/proc/PID/cgroup`. The cgroup v2 line (`0::`) wins; on cgroup v1 the
/// first line with a container or pod in its path does.
#[must_use]
pub fn parse(contents: &str) -> CgroupIds {
    let paths = contents.lines().filter_map(|line| {
        let mut fields = line.splitn(3, ':');
        let hierarchy = fields.next()?;
        let _controllers = fields.next()?;
        Some((hierarchy == "0", fields.next()?))
    });
    let mut best = CgroupIds::default();
    for (unified, path) in paths {
        let ids = ids_of_path(path);
        if ids == CgroupIds::default() {
            continue;
        }
        if unified {
            return ids;
        }
        if best == CgroupIds::default() {
            best = ids;
        }
    }
    best
}

fn ids_of_path(path: &str) -> CgroupIds {
    let mut ids = CgroupIds::default();
    for segment in path.split('/') {
        if let Some(uid) = pod_uid(segment) {
            ids.pod_uid = Some(uid);
        }
        if let Some(id) = container_id(segment) {
            ids.container_id = Some(id);
        }
    }
    ids
}

/// `pod<uid>` (cgroupfs) or `...-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".slice").unwrap_or(segment);
    let at = segment.rfind("pod")?;
    if at > 0 && !segment[..at].ends_with('-') {
        return None;
    }
    let uid = segment[at + 3..].replace('_', "-");
    let groups: Vec<&str> = uid.split('-').collect();
    let shape_ok = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()));
    shape_ok.then(|| uid.to_ascii_lowercase())
}

/// `<64 hex>` (cgroupfs), `cri-containerd-<id>.scope`, `crio-<id>.scope`, `docker-<id>.scope`,
/// `crio-<id>` (CRI-O on cgroupfs). Runtime monitors (`crio-conmon-<id>`) are not containers.
fn container_id(segment: &str) -> Option<String> {
    let segment = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = ["cri-containerd-", "crio-", "docker-", "containerd-", "libpod-"]
        .iter()
        .find_map(|prefix| segment.strip_prefix(prefix))
        .unwrap_or(segment);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4bd3b4dbe4c1a2b7e0b3e9d1ed3d52a1c0e7b2f4a6c9d8e7f1a2b3c4d5e6f7a8";
    const UID: &str = "2b1a6f0e-3c4d-4e5f-8a9b-0c1d2e3f4a5b";

    fn ids(pod: bool) -> CgroupIds {
        CgroupIds { pod_uid: pod.then(|| UID.to_owned()), container_id: Some(ID.to_owned()) }
    }

    #[test]
    fn real_world_shapes() {
        let u = UID.replace('-', "_");
        let cases: Vec<(String, CgroupIds)> = vec![
            // cgroup v2, systemd driver, containerd (GKE, EKS, kubeadm defaults)
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope\n"
                ),
                ids(true),
            ),
            // Guaranteed QoS has no QoS level in the path
            (format!("0::/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope\n"), ids(true)),
            // CRI-O, systemd (OpenShift)
            (
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/crio-{ID}.scope\n"
                ),
                ids(true),
            ),
            // cgroup v2, cgroupfs driver, containerd
            (format!("0::/kubepods/burstable/pod{UID}/{ID}\n"), ids(true)),
            // CRI-O on cgroupfs
            (format!("0::/kubepods/besteffort/pod{UID}/crio-{ID}\n"), ids(true)),
            // kind / nested kubelet
            (
                format!(
                    "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{u}.slice/cri-containerd-{ID}.scope\n"
                ),
                ids(true),
            ),
            // cgroup v1, cgroupfs driver (one line per controller)
            (
                format!(
                    "12:memory:/kubepods/besteffort/pod{UID}/{ID}\n11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{ID}\n1:name=systemd:/kubepods/besteffort/pod{UID}/{ID}\n"
                ),
                ids(true),
            ),
            // cgroup v1, systemd driver, Docker shim
            (
                format!(
                    "10:pids:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/docker-{ID}.scope\n"
                ),
                ids(true),
            ),
            // plain Docker, no Kubernetes
            (format!("0::/system.slice/docker-{ID}.scope\n"), ids(false)),
            (format!("13:blkio:/docker/{ID}\n"), ids(false)),
            // Podman
            (format!("0::/machine.slice/libpod-{ID}.scope\n"), ids(false)),
        ];
        for (text, want) in cases {
            assert_eq!(parse(&text), want, "{text}");
        }
    }

    #[test]
    fn hosts_monitors_and_garbage_yield_nothing() {
        for text in [
            "0::/system.slice/haproxy.service\n",
            "0::/user.slice/user-1000.slice/session-3.scope\n",
            "0::/\n",
            &format!("0::/kubepods.slice/kubepods-pod{}.slice/crio-conmon-{ID}.scope\n", "x".repeat(36)),
            "garbage",
            "",
            "0::/kubepods/podnot-a-uid/abc\n",
            "0::/kubepods/burstable/xpod2b1a6f0e-3c4d-4e5f-8a9b-0c1d2e3f4a5b/short\n",
        ] {
            assert_eq!(parse(text), CgroupIds::default(), "{text}");
        }
    }

    #[test]
    fn unified_line_wins_over_v1_lines() {
        let text = format!("5:memory:/docker/{}\n0::/kubepods/burstable/pod{UID}/{ID}\n", "f".repeat(64));
        assert_eq!(parse(&text), ids(true));
    }

    proptest::proptest! {
        /// The file comes from another process: any text parses to ids or to nothing.
        #[test]
        fn any_text_parses(text in "\\PC{0,200}") {
            let _ = parse(&text);
        }
    }
}
