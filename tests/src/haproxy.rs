//! A real `HAProxy` (Debian's package) run in the foreground by a test, under a command name of its
//! own (a symlink), so each test's agent traces only that test's `HAProxy`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A command name unique to this test process and call (at most 15 bytes, as the kernel keeps).
#[must_use]
pub fn unique_comm() -> String {
    format!("hap{}x{}", std::process::id() % 100_000, NEXT.fetch_add(1, Ordering::Relaxed))
}

#[derive(Debug)]
pub struct Haproxy {
    pub comm: String,
    dir: PathBuf,
    config: PathBuf,
    children: Vec<Child>,
}

fn haproxy_binary() -> PathBuf {
    for p in ["/usr/sbin/haproxy", "/usr/local/sbin/haproxy", "/usr/bin/haproxy"] {
        if std::path::Path::new(p).exists() {
            return p.into();
        }
    }
    panic!("haproxy is not installed; run `make setup` (apt-get install haproxy)");
}

impl Haproxy {
    /// Starts `HAProxy` with `config` under command name `comm`, and waits until `wait_port` accepts
    /// connections.
    #[must_use]
    pub fn start(comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_with(comm, config, wait_port, &[])
    }

    /// Master-worker mode (`-W`): a master process that forks the worker and reloads on SIGUSR2.
    #[must_use]
    pub fn start_master_worker(comm: &str, config: &str, wait_port: u16) -> Self {
        Self::start_with(comm, config, wait_port, &["-W".to_owned()])
    }

    /// Another instance with the same command name, in a directory of its own (`instance`).
    #[must_use]
    pub fn start_in(comm: &str, instance: &str, config: &str, wait_port: u16) -> Self {
        Self::start_at(comm, &format!("{comm}-{instance}"), config, wait_port, &[])
    }

    fn start_with(comm: &str, config: &str, wait_port: u16, args: &[String]) -> Self {
        Self::start_at(comm, comm, config, wait_port, args)
    }

    fn start_at(comm: &str, dir_name: &str, config: &str, wait_port: u16, args: &[String]) -> Self {
        let dir = std::env::temp_dir().join(format!("tracetap-e2e-{dir_name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let link = dir.join(comm);
        std::os::unix::fs::symlink(haproxy_binary(), &link).expect("symlink haproxy");
        let config_path = dir.join("haproxy.cfg");
        std::fs::write(&config_path, config).expect("write config");
        let mut h = Self { comm: comm.to_owned(), dir, config: config_path, children: Vec::new() };
        h.spawn(args);
        h.wait_port(wait_port);
        h
    }

    fn spawn(&mut self, extra: &[String]) {
        let child = Command::new(self.dir.join(&self.comm))
            .arg("-db")
            .arg("-f")
            .arg(&self.config)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join(format!("stderr.{}", self.children.len()))).expect("log file"))
            .spawn()
            .expect("start haproxy");
        self.children.push(child);
    }

    fn wait_port(&self, port: u16) {
        let up = crate::wait_for(Duration::from_secs(10), || std::net::TcpStream::connect(("127.0.0.1", port)).ok());
        if up.is_none() {
            let log = std::fs::read_to_string(self.dir.join(format!("stderr.{}", self.children.len() - 1)))
                .unwrap_or_default();
            panic!("haproxy did not listen on port {port}; its stderr:\n{log}\nconfig:\n{}", self.config_text());
        }
    }

    /// The configuration `HAProxy` runs with.
    #[must_use]
    pub fn config_text(&self) -> String {
        std::fs::read_to_string(&self.config).expect("config")
    }

    /// Pid of the newest `HAProxy` process.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.children.last().expect("started").id()
    }

    /// Master-worker reload: SIGUSR2 to the master, which starts a new worker; the old one
    /// finishes its connections and exits.
    pub fn reload_master(&self) {
        let status = Command::new("kill").arg("-USR2").arg(self.pid().to_string()).status().expect("kill");
        assert!(status.success());
    }

    /// Seamless reload: a new process takes over the listeners (`-sf old`), the old one finishes
    /// its connections and exits.
    pub fn reload(&mut self, wait_port: u16) {
        let old = self.pid();
        self.spawn(&["-sf".to_owned(), old.to_string()]);
        self.wait_port(wait_port);
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A minimal HTTP configuration: frontend `fe_main` on `front_port`, backend `be_app` with one
/// server per address, and `extra` appended.
#[must_use]
pub fn config(front_port: u16, servers: &[std::net::SocketAddr], extra: &str) -> String {
    let mut cfg = format!(
        "global\n    maxconn 4096\n\ndefaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n\n\
         frontend fe_main\n    bind 127.0.0.1:{front_port}\n    default_backend be_app\n\nbackend be_app\n"
    );
    for (i, s) in servers.iter().enumerate() {
        let _ = writeln!(cfg, "    server s{i} {s}");
    }
    cfg.push_str(extra);
    cfg
}
