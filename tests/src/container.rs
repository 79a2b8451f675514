//! The agent run exactly as `deploy/kubernetes/daemonset.yaml` runs it, without a Docker engine:
//! the image's root filesystem assembled the way `deploy/Dockerfile`'s `runtime` stage builds it,
//! and `container-run` (this crate's binary) doing what runc does with the manifest's settings.
//! Also the kubelet-shaped cgroups that pods' containers run in.
//!
//! The image root is `.tools/image` (`make setup`: `debootstrap --variant=minbase bookworm`, the
//! Debian the Dockerfile's `debian:bookworm-slim` is) with the agent binary copied to
//! [`IMAGE_BINARY`]. Deviation from a kubelet, on purpose: the agent keeps the host's network
//! namespace (no CNI here), so its admin port, the fake API server and the OTLP receiver meet on
//! loopback.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::agent::Agent;

/// Where the image has the agent (`deploy/Dockerfile`'s `COPY` destination and `ENTRYPOINT`).
pub const IMAGE_BINARY: &str = "/usr/local/bin/tracetap";
/// The `DaemonSet`'s state volume (`TRACETAP_STATE_DIR`, a hostPath).
pub const STATE_DIR: &str = "/var/lib/tracetap";
/// The capabilities the `DaemonSet` adds after dropping all (`container-run --caps` spelling).
pub const DAEMONSET_CAPS: [&str; 4] = ["bpf", "perfmon", "sys_ptrace", "dac_read_search"];

/// containerd's current `RuntimeDefault` seccomp profile (see `tests/data/seccomp/README.md`).
#[must_use]
pub fn runtime_default_profile() -> PathBuf {
    crate::seccomp::data_dir().join("containerd-runtime-default.json")
}

/// containerd's `RuntimeDefault` before it had the `CAP_BPF` case (v1.6.8).
#[must_use]
pub fn profile_before_cap_bpf() -> PathBuf {
    crate::seccomp::data_dir().join("containerd-runtime-default-before-cap-bpf.json")
}

/// The profile the project ships for `seccompProfile: Localhost`.
#[must_use]
pub fn shipped_profile() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/seccomp/tracetap.json")
}

/// The image's root filesystem with the agent under test at [`IMAGE_BINARY`]: `TRACETAP_IMAGE_ROOT`,
/// else `.tools/image`. The binary is replaced by rename, so an agent running from the old one
/// keeps it.
///
/// # Panics
/// When the tree is missing (run `make setup`) or the binary cannot be copied.
#[must_use]
pub fn image_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    // Once per test process: replacing the binary under a running agent would leave its
    // `/proc/PID/exe` pointing at a deleted file.
    ROOT.get_or_init(|| {
        let root = std::env::var_os("TRACETAP_IMAGE_ROOT")
            .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/image"), PathBuf::from);
        assert!(
            root.join(".complete").exists(),
            "{} is not a complete Debian tree: run `make setup` (debootstraps bookworm there)",
            root.display()
        );
        let target = root.join(IMAGE_BINARY.trim_start_matches('/'));
        let staging = target.with_extension(format!("new.{}", std::process::id()));
        std::fs::create_dir_all(target.parent().expect("parent")).expect("image bin dir");
        std::fs::copy(crate::agent::binary(), &staging).expect("copying the agent into the image");
        std::fs::rename(&staging, &target).expect("installing the agent in the image");
        root
    })
    .clone()
}

/// How the container is made: the manifest's settings, and what a test varies.
#[derive(Debug, Clone)]
pub struct DaemonSetPod {
    /// The seccomp profile (`RuntimeDefault` as containerd has it, unless a test says otherwise).
    pub seccomp: PathBuf,
    /// The host directory behind the state hostPath.
    pub state: PathBuf,
    /// More read-only mounts (host path, container path): a kubeconfig, for instance.
    pub binds: Vec<(PathBuf, String)>,
    /// The agent's own kubelet-shaped cgroup (it also gets a cgroup namespace there).
    pub cgroup: Option<PathBuf>,
    /// The capabilities the container keeps ([`DAEMONSET_CAPS`] unless a test takes some away).
    pub caps: Vec<&'static str>,
}

impl DaemonSetPod {
    /// The manifest's pod with containerd's current `RuntimeDefault` and a fresh state directory.
    #[must_use]
    pub fn new(state: &Path) -> Self {
        Self {
            seccomp: runtime_default_profile(),
            state: state.to_owned(),
            binds: Vec::new(),
            cgroup: None,
            caps: DAEMONSET_CAPS.to_vec(),
        }
    }

    /// The `container-run` command line that starts the agent in this pod.
    #[must_use]
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(runner());
        cmd.arg("--root").arg(image_root()).args(["--hostname", "tracetap-node-a"]);
        cmd.arg("--caps").arg(self.caps.join(",")).arg("--seccomp").arg(&self.seccomp);
        cmd.arg("--bind").arg(format!("{}:{STATE_DIR}:rw", self.state.display()));
        for (host, inside) in &self.binds {
            cmd.arg("--bind").arg(format!("{}:{inside}", host.display()));
        }
        if let Some(cgroup) = &self.cgroup {
            cmd.arg("--cgroup").arg(cgroup);
        }
        cmd.args(["--", IMAGE_BINARY]);
        cmd
    }

    /// Starts the agent in the pod with `env` (plus `TRACETAP_STATE_DIR`), without waiting.
    #[must_use]
    pub fn spawn(&self, env: &[(&str, String)]) -> Agent {
        let mut env = env.to_vec();
        env.push(("TRACETAP_STATE_DIR", STATE_DIR.to_owned()));
        Agent::spawn_command(self.command(), &env)
    }

    /// [`DaemonSetPod::spawn`], then waits until the agent is ready.
    #[must_use]
    pub fn start(&self, env: &[(&str, String)]) -> Agent {
        let agent = self.spawn(env);
        agent.wait_ready();
        agent
    }
}

/// `container-run`, which cargo builds beside the test executables (`target/*/deps/..`).
fn runner() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    let bin = exe.parent().and_then(Path::parent).expect("target dir").join("container-run");
    assert!(bin.exists(), "{} is missing: cargo builds it with this crate's tests", bin.display());
    bin
}

/// Where cgroup v2 is mounted (`/sys/fs/cgroup` or, on hybrid hosts, `/sys/fs/cgroup/unified`).
///
/// # Panics
/// Without a cgroup v2 hierarchy.
#[must_use]
pub fn cgroup2_root() -> PathBuf {
    let mounts = std::fs::read_to_string("/proc/self/mounts").expect("/proc/self/mounts");
    mounts
        .lines()
        .find_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
        })
        .expect("a cgroup v2 hierarchy is mounted")
}

/// A pod-and-container cgroup as the kubelet and containerd name them (systemd driver, burstable
/// `QoS`); processes in it are moved back to the root and the directories removed on drop.
#[derive(Debug)]
pub struct PodCgroup {
    root: PathBuf,
    /// Directories this cgroup created, outermost first.
    created: Vec<PathBuf>,
    pub dir: PathBuf,
}

impl PodCgroup {
    /// # Panics
    /// When the directories cannot be made (no root, no cgroup v2).
    #[must_use]
    pub fn create(pod_uid: &str, container_id: &str) -> Self {
        let root = cgroup2_root();
        let pod_slice = format!("kubepods-burstable-pod{}.slice", pod_uid.replace('-', "_"));
        let scope = format!("cri-containerd-{container_id}.scope");
        let mut created = Vec::new();
        let mut dir = root.clone();
        for part in ["kubepods.slice", "kubepods-burstable.slice", &pod_slice, &scope] {
            dir.push(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
                created.push(dir.clone());
            }
        }
        Self { root, created, dir }
    }

    /// Moves `pid` (its whole thread group) into the cgroup.
    ///
    /// # Panics
    /// When the kernel refuses.
    pub fn enter(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("moving a process into the pod cgroup");
    }
}

impl Drop for PodCgroup {
    fn drop(&mut self) {
        for dir in self.created.iter().rev() {
            if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                for pid in procs.lines() {
                    let _ = std::fs::write(self.root.join("cgroup.procs"), pid);
                }
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}
