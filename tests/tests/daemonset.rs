//! The agent run exactly as `deploy/kubernetes/daemonset.yaml` runs it (see
//! `tracetap_tests::container`): the image's root read-only in its own mount namespace, host pid
//! namespace, uid 0 with the bounding set cut to the four capabilities, `no_new_privs`, the state
//! hostPath writable, and containerd's `RuntimeDefault` seccomp profile, against `HAProxy` 2.6 and
//! 3.0 each in a pod-shaped container of its own. Then the seccomp profiles: one from before the
//! `CAP_BPF` case (the agent must exit at once and say why), and the profile the project ships
//! for `seccompProfile: Localhost` (the agent must trace).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use tracetap_tests::agent::Agent;
use tracetap_tests::client::Conn;
use tracetap_tests::container::{self, DaemonSetPod, PodCgroup};
use tracetap_tests::haproxy::{self, Haproxy, PodShape, Version};
use tracetap_tests::kube_api::{FakeApiServer, FakePod};
use tracetap_tests::otlp::Received;
use tracetap_tests::seccomp::Profile;
use tracetap_tests::{Rig, free_port, require_root, wait_for};

/// Identical requests per pod and phase.
const REQUESTS: usize = 8;

/// Where the kubelet mounts a pod's service account.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The `DaemonSet`'s capabilities as `/proc/PID/status` shows them: `CAP_DAC_READ_SEARCH` (2),
/// `CAP_SYS_PTRACE` (19), `CAP_PERFMON` (38), `CAP_BPF` (39).
const DAEMONSET_CAP_MASK: u64 = (1 << 2) | (1 << 19) | (1 << 38) | (1 << 39);

/// One `HAProxy` pod of the test: its version, API object, cgroup and process.
struct HaproxyPod {
    version: Version,
    pod: FakePod,
    container_id: String,
    port: u16,
    /// Its TLS frontend (HTTP/1.1 and HTTP/2 by ALPN).
    tls_port: u16,
    proxy: Haproxy,
    _cgroup: PodCgroup,
}

fn haproxy_pods(rig: &Rig) -> Vec<HaproxyPod> {
    let specs = [
        (Version::Debian12, "edge-5f6d-a1", "1a2b3c4d-0000-4000-8000-000000000026", "edge", "c26"),
        (Version::Debian13, "internal-5f6d-b2", "1a2b3c4d-0000-4000-8000-000000000030", "internal", "c30"),
    ];
    specs
        .into_iter()
        .map(|(version, name, uid, tier, id)| {
            let container_id = id.repeat(22)[..64].to_owned();
            let cgroup = PodCgroup::create(uid, &container_id);
            let (port, tls_port) = (free_port(), free_port());
            let frontend = format!("fe_{tier}");
            let root = if version == Version::Debian12 { haproxy::bookworm_root() } else { haproxy::trixie_root() };
            let pem = tracetap_tests::tls::certificate_in(&root);
            let config = haproxy::config(port, &[rig.backend.addr], "").replace("fe_main", &frontend)
                + &format!(
                    "\nfrontend {frontend}_tls\n    bind 127.0.0.1:{tls_port} ssl crt {pem} alpn h2,http/1.1\n    default_backend be_app\n"
                );
            let shape = PodShape { cgroup: cgroup.dir.clone(), hostname: name.to_owned() };
            let proxy = Haproxy::start_in_pod(version, &rig.comm, &config, port, shape);
            let pod = FakePod {
                name: name.into(),
                uid: uid.into(),
                labels: vec![("tier".into(), tier.into())],
                deployment: tier.into(),
            };
            HaproxyPod { version, pod, container_id, port, tls_port, proxy, _cgroup: cgroup }
        })
        .collect()
}

/// `count` requests to `port`, on as many connections at once, all for the same path.
fn send(port: u16, count: usize) {
    std::thread::scope(|s| {
        for _ in 0..count {
            s.spawn(move || {
                let mut conn = Conn::connect(format!("127.0.0.1:{port}").parse().expect("addr")).expect("connect");
                assert_eq!(conn.get("/same", &[]).expect("request").status, 200);
            });
        }
    });
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':').map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

fn same_namespace(pid: u32, ns: &str) -> bool {
    let link = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/{ns}")).expect("namespace link");
    link(&pid.to_string()) == link("self")
}

/// The process runs as the manifest's container: asserted from what the kernel reports for it.
fn assert_runs_as_the_daemonset_container(pid: u32) {
    let caps = |f| u64::from_str_radix(&status_field(pid, f), 16).expect("capability set");
    assert_eq!(caps("CapBnd"), DAEMONSET_CAP_MASK, "bounding set: the four capabilities");
    assert_eq!(caps("CapEff"), DAEMONSET_CAP_MASK, "effective set: the four capabilities");
    assert_eq!(caps("CapPrm"), DAEMONSET_CAP_MASK, "permitted set: the four capabilities");
    assert_eq!(caps("CapInh"), 0);
    assert_eq!(caps("CapAmb"), 0);
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
    assert_eq!(status_field(pid, "Seccomp"), "2", "a seccomp filter is on");
    assert_eq!(status_field(pid, "Uid").split_whitespace().next(), Some("0"));
    assert!(same_namespace(pid, "pid"), "hostPID");
    assert!(!same_namespace(pid, "mnt") && !same_namespace(pid, "uts"), "its own mount and UTS namespaces");
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root = mountinfo.lines().find(|l| l.split_whitespace().nth(4) == Some("/")).expect("a root mount");
    let options = root.split_whitespace().nth(5).expect("mount options");
    assert!(options.split(',').any(|o| o == "ro"), "readOnlyRootFilesystem: {root}");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    assert_eq!(exe, Path::new(container::IMAGE_BINARY), "the image's binary");
}

/// `count` requests over TLS to `port`, each on a new connection (`curl`), with HTTP `version`
/// (`1.1` or `2`), to `path`.
fn send_tls(port: u16, count: usize, version: &str, path: &str) {
    for _ in 0..count {
        let out = std::process::Command::new("curl")
            .args(["-sk", "-o", "/dev/null", "-w", "%{http_code} %{http_version}", &format!("--http{version}")])
            .arg(format!("https://127.0.0.1:{port}{path}"))
            .output()
            .expect("curl (make setup installs it)");
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("200 {version}"), "TLS request answered");
    }
}

/// TLS as the `DaemonSet` runs the agent (four capabilities, `RuntimeDefault` seccomp, its own
/// mount namespace): every request over HTTP/1.1 and HTTP/2 has its SERVER span, `https`, with its
/// CLIENT span under it.
fn assert_tls_traced(rig: &Rig, p: &HaproxyPod, agent: &Agent) {
    for (version, path) in [("1.1", "/tls-h1"), ("2", "/tls-h2")] {
        send_tls(p.tls_port, REQUESTS, version, path);
        let got = wait_for(Duration::from_secs(20), || {
            let spans: Vec<Received> = rig
                .receiver
                .spans()
                .into_iter()
                .filter(|s| s.resource_str("k8s.pod.name") == Some(p.pod.name.as_str()))
                .collect();
            let servers: Vec<&Received> =
                spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)).collect();
            let linked = servers
                .iter()
                .filter(|server| spans.iter().any(|c| c.is_client() && c.span.parent_span_id == server.span.span_id))
                .count();
            (servers.len() == REQUESTS && linked == REQUESTS).then(|| {
                servers.iter().all(|s| {
                    s.str_attr("url.scheme") == Some("https") && s.str_attr("network.protocol.version") == Some(version)
                })
            })
        });
        assert_eq!(
            got,
            Some(true),
            "{}: HTTP/{version} over TLS traced and linked; agent log:\n{}",
            p.version,
            agent.log()
        );
        println!("[daemonset] {} in pod {}: {REQUESTS} HTTP/{version} requests over TLS traced", p.version, p.pod.name);
    }
}

/// Waits until the receiver holds at least `n` spans of pod `name`, then returns them.
fn spans_of(rig: &Rig, name: &str, n: usize, agent: &Agent) -> Vec<Received> {
    let got = wait_for(Duration::from_secs(20), || {
        let spans: Vec<Received> =
            rig.receiver.spans().into_iter().filter(|s| s.resource_str("k8s.pod.name") == Some(name)).collect();
        (spans.len() >= n).then_some(spans)
    });
    got.unwrap_or_else(|| panic!("no {n} spans of pod {name}; agent log:\n{}", agent.log()))
}

#[test]
fn the_agent_in_its_daemonset_container_traces_haproxy_pods_of_both_versions() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let pods = haproxy_pods(&rig);
    let api = FakeApiServer::start_in_cluster(&rig.rt, &pods.iter().map(|p| p.pod.clone()).collect::<Vec<_>>());
    let state = tempfile::tempdir().expect("state dir");
    let agent_cgroup = PodCgroup::create("9f9f9f9f-0000-4000-8000-00000000a9e7", &"a9".repeat(32));
    let mut pod = DaemonSetPod::new(state.path());
    // As the kubelet mounts the service account (automountServiceAccountToken) and names the API
    // server; the image has no CA certificates of its own.
    pod.binds.push((api.service_account_dir().to_owned(), SERVICE_ACCOUNT.to_owned()));
    pod.cgroup = Some(agent_cgroup.dir.clone());
    let mut env = rig.agent_env();
    env.extend(api.in_cluster_env());
    env.extend([
        ("NODE_NAME", "node-a".to_owned()),
        // The tail store lives on the state hostPath: every span goes through it.
        ("TRACETAP_TAIL_ENABLED", "true".to_owned()),
        ("TRACETAP_TAIL_MAX_MEMORY_BYTES", "0".to_owned()),
        ("TRACETAP_TAIL_KEEP_ERRORS", "false".to_owned()),
        ("TRACETAP_TAIL_RATIO", "1.0".to_owned()),
        ("TRACETAP_TAIL_GRACE", "300ms".to_owned()),
        ("TRACETAP_TAIL_DECISION_WAIT", "3s".to_owned()),
    ]);
    let agent = pod.start(&env);
    assert_runs_as_the_daemonset_container(agent.pid());
    let known = wait_for(Duration::from_secs(10), || (agent.metric("tracetap_k8s_pods") == 2).then_some(()));
    assert!(known.is_some(), "the pod watch lists both pods; agent log:\n{}", agent.log());

    for p in &pods {
        send(p.port, REQUESTS);
    }
    for p in &pods {
        let spans = spans_of(&rig, &p.pod.name, 2 * REQUESTS, &agent);
        assert_eq!(spans.len(), 2 * REQUESTS, "{}: a SERVER and a CLIENT span per request", p.version);
        for s in &spans {
            assert_eq!(s.resource_str("container.id"), Some(p.container_id.as_str()), "{}", p.version);
            assert_eq!(s.resource_str("k8s.pod.uid"), Some(p.pod.uid.as_str()), "{}", p.version);
            assert_eq!(s.resource_str("k8s.namespace.name"), Some("edge"));
            assert_eq!(s.resource_str("k8s.deployment.name"), Some(p.pod.deployment.as_str()));
            assert_eq!(s.resource_str("k8s.node.name"), Some("node-a"));
            assert_eq!(s.service, p.pod.deployment, "service.name from the owning Deployment");
        }
        let frontend = format!("fe_{}", p.pod.deployment);
        let servers: Vec<_> = spans.iter().filter(|s| s.is_server()).collect();
        assert_eq!(servers.len(), REQUESTS);
        assert!(
            servers.iter().all(|s| s.str_attr("haproxy.frontend") == Some(frontend.as_str())),
            "{}: frontend named from its configuration, read through /proc/PID/root",
            p.version
        );
        let clients = spans.iter().filter(|s| s.is_client());
        assert!(clients.clone().all(|s| s.str_attr("haproxy.backend") == Some("be_app")), "{}", p.version);
        println!(
            "[daemonset] {} in pod {} (pid {}): {} spans, container.id {}…, frontend {frontend}",
            p.version,
            p.pod.name,
            p.proxy.pid(),
            spans.len(),
            &p.container_id[..12]
        );
    }
    let (_, ready) = agent.get("/readyz").expect("/readyz");
    assert!(ready.contains("tls: uprobe-multi links"), "TLS through uprobe-multi links: {ready}");
    for p in &pods {
        assert_tls_traced(&rig, p, &agent);
    }
    let stored: Vec<_> = std::fs::read_dir(state.path()).expect("state dir").flatten().map(|e| e.file_name()).collect();
    assert!(!stored.is_empty(), "the tail store was written to the state hostPath");
    assert_eq!(agent.metric("tracetap_k8s_api_errors_total"), 0, "agent log:\n{}", agent.log());
    let requests = api.requests.lock().expect("lock").clone();
    assert!(
        !requests.is_empty() && requests.iter().all(|r| r.ends_with(" bearer")),
        "every API request over TLS with the service account's token: {requests:?}"
    );
    drop(agent);

    // The selector: a second agent, same container, selects the 2.6 pod only.
    let before = rig.receiver.spans().len();
    env.retain(|(k, _)| !k.starts_with("TRACETAP_TAIL"));
    env.push(("TRACETAP_K8S_POD_SELECTOR", "tier=edge".to_owned()));
    let state = tempfile::tempdir().expect("state dir");
    let mut selective = DaemonSetPod::new(state.path());
    selective.binds = pod.binds.clone();
    let agent = selective.start(&env);
    let one_left_out =
        wait_for(Duration::from_secs(10), || (agent.metric("tracetap_k8s_targets_not_selected") >= 1).then_some(()));
    assert!(one_left_out.is_some(), "the 3.0 pod is not selected; agent log:\n{}", agent.log());
    for p in &pods {
        send(p.port, REQUESTS);
    }
    let edge = &pods[0].pod.name;
    let got = wait_for(Duration::from_secs(20), || (rig.receiver.spans().len() >= before + 2 * REQUESTS).then_some(()));
    assert!(got.is_some(), "spans of the selected pod; agent log:\n{}", agent.log());
    std::thread::sleep(Duration::from_millis(500));
    let new: Vec<Received> = rig.receiver.spans().into_iter().skip(before).collect();
    let pods_seen: BTreeSet<&str> = new.iter().filter_map(|s| s.resource_str("k8s.pod.name")).collect();
    assert_eq!(pods_seen, BTreeSet::from([edge.as_str()]), "only the selected pod is traced");
    assert_eq!(new.len(), 2 * REQUESTS);
    println!("[daemonset] TRACETAP_K8S_POD_SELECTOR=tier=edge: {} spans, all of pod {edge}", new.len());
}

/// Starts the agent in `pod` and waits for it to exit by itself, as it must when it cannot load
/// its probes: its exit status (a failure of the agent, not of the runner) and its log.
fn exit_of(pod: &DaemonSetPod, rig: &Rig) -> (std::process::ExitStatus, String) {
    let mut agent = pod.spawn(&rig.agent_env());
    let status = agent.wait_exit(Duration::from_secs(20));
    let log = agent.log();
    let status = status.unwrap_or_else(|| panic!("the agent keeps running without its probes; log:\n{log}"));
    assert!(
        !status.success() && status.code() != Some(125),
        "the agent (not the runner) failed: {status}; log:\n{log}"
    );
    (status, log)
}

#[test]
fn under_a_profile_without_the_cap_bpf_case_the_agent_exits_at_once_naming_seccomp() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let state = tempfile::tempdir().expect("state dir");
    let mut pod = DaemonSetPod::new(state.path());
    pod.seccomp = container::profile_before_cap_bpf();
    let (status, log) = exit_of(&pod, &rig);
    for needle in [
        "seccomp",
        "bpf()",
        "CAP_BPF",
        "containerd 1.6.9",
        "Docker Engine 23.0",
        "containers/common issue 1988",
        "deploy/seccomp/tracetap.json",
        "localhostProfile: profiles/tracetap.json",
    ] {
        assert!(log.contains(needle), "the message names {needle:?}; log:\n{log}");
    }
    assert!(!log.contains("needs root"), "no advice to run as root; log:\n{log}");
    let line = log.lines().find(|l| l.contains("seccomp")).unwrap_or_default();
    println!("[daemonset] under containerd 1.6.8's RuntimeDefault the agent exits ({status}): {line}");
}

/// The diagnosis blames seccomp only when seccomp is the cause: without `CAP_BPF` the kernel
/// itself refuses, under the same filter, and the message says what is missing instead.
#[test]
fn without_cap_bpf_under_a_filter_the_message_names_the_capability_not_seccomp() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let state = tempfile::tempdir().expect("state dir");
    let mut pod = DaemonSetPod::new(state.path());
    pod.caps.retain(|c| *c != "bpf");
    let (_, log) = exit_of(&pod, &rig);
    assert!(log.contains("CAP_BPF") && log.contains("needs root"), "the generic message; log:\n{log}");
    assert!(!log.contains("seccomp"), "seccomp is not blamed; log:\n{log}");
}

#[test]
fn the_shipped_localhost_profile_lets_the_agent_trace() {
    if !require_root() {
        return;
    }
    let rig = Rig::new();
    let port = free_port();
    let _proxy = Haproxy::start_on(Version::Debian12, &rig.comm, &haproxy::config(port, &[rig.backend.addr], ""), port);
    let state = tempfile::tempdir().expect("state dir");
    let mut pod = DaemonSetPod::new(state.path());
    pod.seccomp = container::shipped_profile();
    let agent = pod.start(&rig.agent_env());
    assert_runs_as_the_daemonset_container(agent.pid());
    send(port, 4);
    let spans = rig.receiver.wait_for_spans(8);
    assert_eq!(spans.len(), 8, "agent log:\n{}", agent.log());
    println!("[daemonset] under deploy/seccomp/tracetap.json: 4 requests, 8 spans");
}

/// The shipped profile is containerd's current `RuntimeDefault` resolved for the `DaemonSet`'s
/// capabilities on amd64 and arm64 (a flat profile: containerd reads `Localhost` files as the OCI
/// runtime spec's `LinuxSeccomp`, where capability conditions do not exist), and the older
/// profile resolved the same way lacks exactly what the agent needs.
#[test]
fn the_shipped_profile_is_runtime_default_for_the_daemonset_capabilities() {
    let caps = ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"];
    let kernel = (5, 17);
    let current = Profile::read(&container::runtime_default_profile());
    let expected = tracetap_tests::seccomp::flatten(&current, &caps, &["amd64", "arm64"], kernel);
    let shipped_path = container::shipped_profile();
    let expected_text = serde_json::to_string_pretty(&expected).expect("json") + "\n";
    if std::env::var_os("TRACETAP_WRITE_SECCOMP_PROFILE").is_some() {
        std::fs::write(&shipped_path, &expected_text).expect("writing the shipped profile");
    }
    let shipped = std::fs::read_to_string(&shipped_path).expect("deploy/seccomp/tracetap.json");
    assert!(
        shipped == expected_text,
        "deploy/seccomp/tracetap.json is not containerd's RuntimeDefault resolved for the DaemonSet's capabilities; \
         regenerate it: TRACETAP_WRITE_SECCOMP_PROFILE=1 cargo test -p tracetap-tests --test daemonset shipped_profile"
    );
    // Independent of the resolution code: what the agent's capabilities add to the base list
    // is there, what only CAP_SYS_ADMIN and others would add is not.
    let shipped_json: serde_json::Value = serde_json::from_str(&shipped).expect("json");
    let allowed: BTreeSet<&str> = shipped_json["syscalls"]
        .as_array()
        .expect("syscalls")
        .iter()
        .filter(|r| r["action"] == "SCMP_ACT_ALLOW" && r.get("args").is_none())
        .flat_map(|r| r["names"].as_array().expect("names").iter().map(|n| n.as_str().expect("name")))
        .collect();
    for present in ["bpf", "perf_event_open", "ptrace", "process_vm_readv", "pidfd_getfd", "open_by_handle_at", "read"]
    {
        assert!(allowed.contains(present), "the shipped profile allows {present}");
    }
    for absent in ["mount", "umount2", "unshare", "setns", "init_module", "kexec_load", "reboot", "chroot", "syslog"] {
        assert!(!allowed.contains(absent), "the shipped profile does not allow {absent}");
    }
    assert!(shipped_json.get("archMap").is_none() && !shipped.contains("\"includes\""), "flat OCI shape");
    let older = Profile::read(&container::profile_before_cap_bpf());
    for arch in ["amd64", "arm64"] {
        let now = current.resolve(&caps, arch, kernel);
        let then = older.resolve(&caps, arch, kernel);
        for needed in ["bpf", "perf_event_open"] {
            assert!(now.allowed().contains(needed), "{arch}: RuntimeDefault allows {needed} with the capabilities");
            assert!(
                !then.allowed().contains(needed),
                "{arch}: containerd 1.6.8 refuses {needed} without CAP_SYS_ADMIN"
            );
        }
        let without_bpf_perfmon = current.resolve(&caps[2..], arch, kernel);
        let added: BTreeSet<&str> = now.allowed().difference(&without_bpf_perfmon.allowed()).copied().collect();
        assert_eq!(
            added,
            BTreeSet::from(["bpf", "perf_event_open"]),
            "{arch}: CAP_BPF and CAP_PERFMON add exactly these"
        );
    }
}

/// The test's container is the one the manifests and the Dockerfile describe.
#[test]
fn the_container_test_matches_the_manifest_and_the_dockerfile() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let daemonset = std::fs::read_to_string(root.join("deploy/kubernetes/daemonset.yaml")).expect("daemonset.yaml");
    let caps: Vec<String> = container::DAEMONSET_CAPS.iter().map(|c| format!("\"{}\"", c.to_uppercase())).collect();
    for needle in [
        format!("add: [{}]", caps.join(", ")),
        "drop: [\"ALL\"]".to_owned(),
        "readOnlyRootFilesystem: true".to_owned(),
        "allowPrivilegeEscalation: false".to_owned(),
        "runAsUser: 0".to_owned(),
        "hostPID: true".to_owned(),
        "type: RuntimeDefault".to_owned(),
        format!("mountPath: {}", container::STATE_DIR),
        // Scheduled on the architectures the image is built for, and only those.
        "values: [\"amd64\", \"arm64\"]".to_owned(),
    ] {
        assert!(daemonset.contains(&needle), "daemonset.yaml has {needle}");
    }
    let dockerfile = std::fs::read_to_string(root.join("deploy/Dockerfile")).expect("Dockerfile");
    let stage = |name: &str| -> Vec<&str> {
        let mut lines =
            dockerfile.lines().skip_while(|l| !(l.starts_with("FROM ") && l.ends_with(&format!(" AS {name}"))));
        let from = lines.next().unwrap_or_else(|| panic!("a stage {name}"));
        std::iter::once(from).chain(lines.take_while(|l| !l.starts_with("FROM "))).collect()
    };
    let base = stage("base");
    assert!(base[0].starts_with("FROM debian:bookworm-"), "the image is Debian 12, as the test's root: {}", base[0]);
    assert!(base.contains(&format!("ENTRYPOINT [\"{}\"]", container::IMAGE_BINARY).as_str()), "{base:?}");
    let runtime = stage("runtime");
    assert_eq!(runtime[0], "FROM base AS runtime");
    let copy = format!("COPY --from=prebuilt ${{TARGETARCH}}/tracetap {}", container::IMAGE_BINARY);
    assert!(
        runtime.contains(&copy.as_str()),
        "the runtime stage puts the prebuilt binary where the test does: {runtime:?}"
    );
    let overlay =
        std::fs::read_to_string(root.join("deploy/overlays/seccomp-localhost/daemonset.yaml")).expect("overlay");
    assert!(
        overlay.contains("localhostProfile: profiles/tracetap.json"),
        "the path the agent's message and docs/deploy.md give"
    );
}
