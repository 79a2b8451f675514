//! Support for tracetap's end-to-end tests: a real `HAProxy` (Debian 12's package, or Debian 13's
//! run like a container: see [`haproxy::Version`]) on loopback ports,
//! a backend HTTP server, an OTLP/HTTP receiver that decodes with `opentelemetry-proto`, a small
//! blocking HTTP/1.1 client, and the real `tracetap` binary.
//!
//! Tests that load eBPF need root: [`require_root`] fails the test without it, unless the caller
//! opts out explicitly with `TRACETAP_TESTS_SKIP_PRIVILEGED=1`.
#![forbid(unsafe_code)]

pub mod agent;
pub mod backend;
pub mod client;
pub mod container;
pub mod continuing;
pub mod h2client;
pub mod h2load;
pub mod haproxy;
pub mod kernel_matrix;
pub mod kube_api;
pub mod linking;
pub mod otlp;
pub mod pki;
pub mod seccomp;
pub mod syslog;
pub mod tls;
pub mod vm;

use std::net::SocketAddr;

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// Fails the test when not root, because the agent cannot load its probes. Returns false (and the
/// test must return at once) only when `TRACETAP_TESTS_SKIP_PRIVILEGED=1` is set.
#[must_use]
pub fn require_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid_is_root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        .is_some_and(|euid| euid == "0");
    if euid_is_root {
        return true;
    }
    if std::env::var("TRACETAP_TESTS_SKIP_PRIVILEGED").as_deref() == Ok("1") {
        eprintln!("SKIPPED: not root and TRACETAP_TESTS_SKIP_PRIVILEGED=1");
        return false;
    }
    panic!(
        "this end-to-end test loads eBPF probes and must run as root (CI does); set TRACETAP_TESTS_SKIP_PRIVILEGED=1 to skip it knowingly"
    );
}

/// A free loopback TCP port (bound and released; good enough for tests on one machine).
/// Mounts tracefs at `/sys/kernel/tracing` unless it is there (systemd mounts it on most hosts;
/// this machine boots without it), as a node has it for the agent's tracefs route.
///
/// # Panics
/// When the mount fails (the tests run as root).
pub fn ensure_tracefs() {
    if std::path::Path::new("/sys/kernel/tracing/uprobe_events").exists() {
        return;
    }
    let status = std::process::Command::new("mount")
        .args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"])
        .status()
        .expect("run mount");
    assert!(status.success() || std::path::Path::new("/sys/kernel/tracing/uprobe_events").exists(), "mount tracefs");
}

#[must_use]
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().expect("local addr").port()
}

/// Polls `check` every 50 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed and reaped when the guard drops, so that a failed assertion does not
/// leave it running (holding the test's output pipes open, and its port).
#[derive(Debug)]
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A runtime shared by the servers of one test.
#[must_use]
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime")
}

/// What most tests start from: a runtime, an OTLP receiver, the test backend, and a command name
/// of their own for HAProxy.
pub struct Rig {
    pub rt: tokio::runtime::Runtime,
    pub receiver: otlp::Receiver,
    pub backend: backend::Backend,
    pub comm: String,
}

impl Rig {
    #[must_use]
    pub fn new() -> Self {
        let rt = runtime();
        let receiver = otlp::Receiver::start(&rt);
        let backend = backend::Backend::start(&rt);
        Self { rt, receiver, backend, comm: haproxy::unique_comm() }
    }

    /// The agent's environment: export to the receiver, trace this rig's HAProxy.
    #[must_use]
    pub fn agent_env(&self) -> Vec<(&'static str, String)> {
        vec![("OTEL_EXPORTER_OTLP_ENDPOINT", self.receiver.endpoint()), ("TRACETAP_TARGET_COMM", self.comm.clone())]
    }
}

impl Default for Rig {
    fn default() -> Self {
        Self::new()
    }
}

/// A traced stack: HAProxy (its own command name) in front of the test backend, an agent tracing
/// it and exporting to an OTLP receiver.
pub struct Stack {
    pub rt: tokio::runtime::Runtime,
    pub receiver: otlp::Receiver,
    pub backend: backend::Backend,
    pub haproxy: haproxy::Haproxy,
    pub agent: agent::Agent,
    /// HAProxy's `fe_main` frontend.
    pub front: SocketAddr,
}

impl Stack {
    /// The standard configuration ([`haproxy::config`]) plus `extra`, and `env` for the agent, on the
    /// version [`haproxy::Version::from_env`] picks.
    #[must_use]
    pub fn start(extra: &str, env: &[(&str, String)]) -> Self {
        Self::with_config(|port, backend| haproxy::config(port, &[backend], extra), env)
    }

    /// [`Stack::start`] on the given `HAProxy` version.
    #[must_use]
    pub fn start_on(version: haproxy::Version, extra: &str, env: &[(&str, String)]) -> Self {
        Self::with_config_on(version, |port, backend| haproxy::config(port, &[backend], extra), env)
    }

    /// A configuration made by `config(frontend port, backend address)`, on the version
    /// [`haproxy::Version::from_env`] picks (Debian 12's 2.6 by default).
    #[must_use]
    pub fn with_config(config: impl FnOnce(u16, SocketAddr) -> String, env: &[(&str, String)]) -> Self {
        Self::with_config_on(haproxy::Version::from_env(), config, env)
    }

    /// [`Stack::with_config`] on the given `HAProxy` version.
    #[must_use]
    pub fn with_config_on(
        version: haproxy::Version,
        config: impl FnOnce(u16, SocketAddr) -> String,
        env: &[(&str, String)],
    ) -> Self {
        Self::with_agent(version, config, env, agent::Agent::start)
    }

    /// [`Stack::with_config_on`] with the agent started by `start` (as root, or as the
    /// `DaemonSet` runs it: [`agent::Agent::start_with_daemonset_capabilities`]).
    #[must_use]
    pub fn with_agent(
        version: haproxy::Version,
        config: impl FnOnce(u16, SocketAddr) -> String,
        env: &[(&str, String)],
        start: fn(&[(&str, String)]) -> agent::Agent,
    ) -> Self {
        let Rig { rt, receiver, backend, comm } = Rig::new();
        let port = free_port();
        let haproxy = haproxy::Haproxy::start_on(version, &comm, &config(port, backend.addr), port);
        let mut vars = vec![("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()), ("TRACETAP_TARGET_COMM", comm)];
        vars.extend(env.iter().cloned());
        let agent = start(&vars);
        Self { rt, receiver, backend, haproxy, agent, front: SocketAddr::from(([127, 0, 0, 1], port)) }
    }

    /// Waits until SERVER spans for every path in `paths` arrived, and returns all spans.
    #[must_use]
    pub fn spans_for(&self, paths: &[&str]) -> Vec<otlp::Received> {
        let found = wait_for(Duration::from_secs(20), || {
            let all = self.receiver.spans();
            paths.iter().all(|p| all.iter().any(|x| x.is_server() && x.str_attr("url.path") == Some(p))).then_some(all)
        });
        found.unwrap_or_else(|| {
            let got: Vec<_> = self
                .receiver
                .spans()
                .iter()
                .map(|s| (s.span.name.clone(), s.str_attr("url.path").map(str::to_owned)))
                .collect();
            panic!("SERVER spans for {paths:?} did not all arrive; got {got:?}\nagent log:\n{}", self.agent.log())
        })
    }

    /// Sends `n` identical requests to `fe_main` (`scheme` `http` or `https`) with `h2load`
    /// (`options`), the backend choosing statuses and delays; asserts each was answered, and
    /// returns the spans once a SERVER span per request arrived (60 s at most, for liveness), with
    /// half a second for stragglers.
    ///
    /// # Panics
    /// When a request is not answered.
    #[must_use]
    pub fn identical_requests(&self, scheme: &str, path: &str, options: &[&str], n: usize) -> Vec<otlp::Received> {
        self.identical_requests_to(self.front, scheme, path, options, n)
    }

    /// [`Stack::identical_requests`] to another of the configuration's frontends, at `front`.
    ///
    /// # Panics
    /// When a request is not answered.
    #[must_use]
    pub fn identical_requests_to(
        &self,
        front: SocketAddr,
        scheme: &str,
        path: &str,
        options: &[&str],
        n: usize,
    ) -> Vec<otlp::Received> {
        let url = format!("{scheme}://{front}{path}");
        let count = n.to_string();
        let cycle = ["-H", "x-want-status: cycle", "-H", "x-delay-ms: random"];
        let out = h2load::run(&[options, &["-n", count.as_str()], &cycle, &[url.as_str()]].concat());
        assert_eq!((out.answered(), out.errored), (n, 0), "every request to {url} answered: {out:?}");
        let servers = |spans: &[otlp::Received]| {
            spans.iter().filter(|s| s.is_server() && s.str_attr("url.path") == Some(path)).count()
        };
        let _ = wait_for(Duration::from_mins(1), || (servers(&self.receiver.spans()) >= n).then_some(()));
        std::thread::sleep(Duration::from_millis(500));
        self.receiver.spans()
    }

    /// The SERVER span of `path` and its CLIENT spans.
    #[must_use]
    pub fn trace_of<'a>(spans: &'a [otlp::Received], path: &str) -> (&'a otlp::Received, Vec<&'a otlp::Received>) {
        let server = spans
            .iter()
            .find(|x| x.is_server() && x.str_attr("url.path") == Some(path))
            .unwrap_or_else(|| panic!("no SERVER span for {path}"));
        let clients = spans.iter().filter(|x| x.is_client() && x.span.parent_span_id == server.span.span_id).collect();
        (server, clients)
    }
}
