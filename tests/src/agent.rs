//! The real `tracetap` binary, started by a test with its own environment.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

/// Path of the built agent: `TRACETAP_BIN`, else `target/debug/tracetap` of this workspace.
#[must_use]
pub fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("TRACETAP_BIN") {
        return p.into();
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"), PathBuf::from);
    let bin = target.join("debug/tracetap");
    assert!(
        bin.exists(),
        "{} is missing: build the agent first (`cargo build -p tracetap`, which `make test` does)",
        bin.display()
    );
    bin
}

#[derive(Debug)]
pub struct Agent {
    child: Option<Child>,
    pub admin: SocketAddr,
    log: PathBuf,
}

impl Agent {
    /// Starts the agent with `env` (plus a free admin port and a 100 ms batch delay unless given)
    /// and waits until `/readyz` answers 200.
    #[must_use]
    pub fn start(env: &[(&str, String)]) -> Self {
        let agent = Self::spawn(env);
        agent.wait_ready();
        agent
    }

    /// Starts the agent before any target runs: waits for its admin endpoint to answer, not for
    /// readiness (which needs a target).
    #[must_use]
    pub fn start_without_targets(env: &[(&str, String)]) -> Self {
        let agent = Self::spawn(env);
        crate::wait_for(Duration::from_secs(20), || agent.get("/readyz")).expect("admin endpoint up");
        agent
    }

    /// Starts the agent without waiting for readiness.
    #[must_use]
    pub fn spawn(env: &[(&str, String)]) -> Self {
        Self::spawn_command(Command::new(binary()), env)
    }

    /// Starts the agent as the `DaemonSet` runs it (deploy/kubernetes/daemonset.yaml): uid 0 with
    /// every capability dropped but `CAP_BPF`, `CAP_PERFMON`, `CAP_SYS_PTRACE` and
    /// `CAP_DAC_READ_SEARCH`, and `no_new_privs`; waits until ready.
    #[must_use]
    pub fn start_with_daemonset_capabilities(env: &[(&str, String)]) -> Self {
        let agent = Self::spawn_with_daemonset_capabilities(env);
        agent.wait_ready();
        agent
    }

    /// [`Agent::start_with_daemonset_capabilities`], waiting only for the admin endpoint to answer
    /// (readiness needs a target).
    #[must_use]
    pub fn start_with_daemonset_capabilities_without_targets(env: &[(&str, String)]) -> Self {
        let agent = Self::spawn_with_daemonset_capabilities(env);
        crate::wait_for(Duration::from_secs(20), || agent.get("/readyz")).expect("admin endpoint up");
        agent
    }

    fn spawn_with_daemonset_capabilities(env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--bounding-set=-all,+bpf,+perfmon,+sys_ptrace,+dac_read_search",
            "--inh-caps=-all",
            "--no-new-privs",
            "--",
        ])
        .arg(binary());
        Self::spawn_command(cmd, env)
    }

    /// The agent's process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The agent's effective capabilities (`CapEff` of its status), as a bit set.
    #[must_use]
    pub fn effective_capabilities(&self) -> u64 {
        let pid = self.child.as_ref().expect("running").id();
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| s.lines().find_map(|l| u64::from_str_radix(l.strip_prefix("CapEff:")?.trim(), 16).ok()))
            .expect("CapEff of the agent")
    }

    /// Starts the agent with its stdout a pipe that nobody reads (a stuck log pipeline: once the
    /// pipe's buffer is full, every write to stdout blocks); waits until ready.
    #[must_use]
    pub fn start_with_stdout_unread(env: &[(&str, String)]) -> Self {
        let agent = Self::spawn_with_stdout(Command::new(binary()), env, Stdio::piped());
        agent.wait_ready();
        agent
    }

    /// Starts `cmd` (which runs the agent) with the harness's environment plus `env`.
    #[must_use]
    pub fn spawn_command(cmd: Command, env: &[(&str, String)]) -> Self {
        Self::spawn_with_stdout(cmd, env, Stdio::null())
    }

    fn spawn_with_stdout(mut cmd: Command, env: &[(&str, String)], stdout: Stdio) -> Self {
        let admin: SocketAddr = format!("127.0.0.1:{}", crate::free_port()).parse().expect("addr");
        let log = std::env::temp_dir().join(format!("tracetap-agent-{}.log", admin.port()));
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("TRACETAP_ADMIN_ADDR", admin.to_string())
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env("TRACETAP_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child =
            cmd.stdout(stdout).stderr(std::fs::File::create(&log).expect("agent log")).spawn().expect("start tracetap");
        Self { child: Some(child), admin, log }
    }

    /// The agent's log so far (stderr).
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `/readyz` answers 200.
    ///
    /// # Panics
    /// When it does not in time (the log is in the message).
    pub fn wait_ready(&self) {
        let ready = crate::wait_for(Duration::from_secs(30), || {
            (self.get("/readyz").map(|(s, _)| s) == Some(200)).then_some(())
        });
        assert!(ready.is_some(), "agent never became ready; its log:\n{}", self.log());
    }

    /// GET on the admin endpoint: (status, body).
    #[must_use]
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut conn = crate::client::Conn::connect(self.admin).ok()?;
        let resp = conn.get(path, &[]).ok()?;
        Some((resp.status, String::from_utf8_lossy(&resp.body).into_owned()))
    }

    /// The value of one metric from `/metrics`.
    #[must_use]
    pub fn metric(&self, name: &str) -> u64 {
        let (_, body) = self.get("/metrics").expect("metrics answer");
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    /// Resident set size of the agent, in KiB (`VmRSS`).
    #[must_use]
    pub fn rss_kib(&self) -> u64 {
        let pid = self.child.as_ref().expect("running").id();
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
            })
            .expect("VmRSS of the agent")
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Waits up to `timeout` for the agent to exit by itself; its status if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        crate::wait_for(timeout, || child.try_wait().ok().flatten())
    }

    /// SIGKILL (a crash: nothing is flushed), then waits for the exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for the exit.
    #[must_use]
    pub fn stop(mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        child.wait().expect("wait agent")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
