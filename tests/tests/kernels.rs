//! The kernel matrix: the kernels nodes run, booted under qemu (`tracetap_tests::vm`), with the
//! agent inside under exactly the `DaemonSet`'s four capabilities, tracing `HAProxy` 2.6 and 3.0
//! through a TLS and a cleartext frontend, HTTP/1.1 and HTTP/2 (the guest half:
//! `src/bin/kernel-guest.rs`). This machine's own kernel is covered by every other test.
//!
//! | kernel | TLS route | `perf_event_paranoid` |
//! |---|---|---|
//! | Debian 12's 6.1 | tracefs uprobe events | 2; at Debian's default 3, the one message instead |
//! | Debian 13's 6.12 | uprobe-multi links | Debian's default 3 |
//! | Debian 12's 6.1, `arm64` | tracefs uprobe events (entry and return probes); as root, perf uprobes | as on `x86_64` |
//!
//! The `x86_64` guests' root is Debian 12's tree `make setup` makes (`.tools/vm-bookworm`:
//! `HAProxy` 2.6, `h2load`), with Debian 13's (`.tools/trixie`, `HAProxy` 3.0) inside it, run the
//! way the other tests run it: in its own mount and pid namespaces. The `arm64` guest boots
//! QEMU's `virt` board with Debian 12's `arm64` tree (`.tools/vm-bookworm-arm64`, `HAProxy` 2.6)
//! and the agent and guest half cross-built for `aarch64` (`make cross-arm64`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tracetap_tests::agent::{self, Agent};
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::vm::{self, Layer, Machine};
use tracetap_tests::{kernel_matrix, require_root};

/// Where `make setup` keeps the trees and kernels.
fn tools() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools")
}

/// Debian 12's kernel: no uprobe-multi links (6.6+), so TLS goes through tracefs uprobe events,
/// which Debian's default `perf_event_paranoid` of 3 refuses without `CAP_SYS_ADMIN`.
#[test]
fn debian_12_kernel_6_1() {
    if !require_root() {
        return;
    }
    let guest = Guest::boot(&Node::x86_64("kernel-bookworm"), "3,2");
    guest.assert_release("6.1.");
    assert_debian_12_kernel(&guest, &haproxy::versions());
}

/// Debian 12's kernel on an `arm64` node: the same as on `x86_64`, with the agent and the probes
/// built for `aarch64`, and the TLS probes at the functions' entries and returns (the call-site
/// templates are `x86_64` code); and as root too. Its spans have the names and attributes of the
/// same run on this machine. `HAProxy` 2.6 only: there is no `arm64` Debian 13 tree.
#[test]
fn debian_12_kernel_6_1_arm64() {
    if !require_root() {
        return;
    }
    let guest = Guest::boot(&Node::aarch64("kernel-bookworm-arm64"), "3,2");
    guest.assert_release("6.1.");
    assert!(guest.fact("machine").starts_with("aarch64"), "an arm64 guest\n{guest}");
    assert_debian_12_kernel(&guest, &[Version::Debian12]);
    // As root, the perf route (CAP_SYS_ADMIN), whatever perf_event_paranoid says.
    let root = "root haproxy=2.6";
    assert_eq!(guest.route(root), "tls: perf uprobes", "[{root}]\n{guest}");
    guest.assert_traced(root, &["clear-h1", "clear-h2", "tls-h1", "tls-h2"]);
    guest.assert_no_tls_loss(root);
    // The same spans as on x86_64: the same run on this machine, its shapes compared.
    let mut reference = BTreeMap::new();
    kernel_matrix::run("x86_64", Version::Debian12, Agent::start, &mut |key, value| {
        reference.insert(key, value);
    });
    for run in [label(2, Version::Debian12).as_str(), root] {
        assert!(
            guest.fact(&format!("placement {run}")).contains("entry and return"),
            "[{run}] TLS probes at entries and returns on arm64\n{guest}"
        );
        for what in ["clear-h1", "clear-h2", "tls-h1", "tls-h2"] {
            let on_x86_64 = reference.get(&format!("shape x86_64 {what}")).expect("the reference run's shape");
            assert_eq!(guest.fact(&format!("shape {run} {what}")), on_x86_64, "[{run}] {what}: names and attributes");
            assert!(on_x86_64.contains("network.protocol.version=StringValue"), "values are compared: {on_x86_64}");
        }
    }
}

/// What Debian 12's kernel gives under the `DaemonSet`'s capabilities: at `perf_event_paranoid`
/// 3, no TLS route and the one message, cleartext traced; at 2, tracefs uprobe events and
/// everything traced.
fn assert_debian_12_kernel(guest: &Guest, versions: &[Version]) {
    guest.assert_paranoid_at_boot(3);
    for &version in versions {
        let refused = label(3, version);
        let route = guest.route(&refused);
        for part in ["tls: none: TLS connections cannot be traced", "kernel.perf_event_paranoid at 3"] {
            assert!(route.contains(part), "[{refused}] /readyz has {part:?}: {route}\n{guest}");
        }
        assert_eq!(guest.metric(&refused, "refusal_messages"), 1, "[{refused}] said once\n{guest}");
        assert!(guest.metric(&refused, "tracetap_tls_hook_failures_total") >= 1, "[{refused}] counted\n{guest}");
        guest.assert_traced(&refused, &["clear-h1", "clear-h2"]);

        let traced = label(2, version);
        assert_eq!(guest.route(&traced), "tls: tracefs uprobe events", "[{traced}]\n{guest}");
        guest.assert_traced(&traced, &["clear-h1", "clear-h2", "tls-h1", "tls-h2"]);
        guest.assert_no_tls_loss(&traced);
    }
}

/// Debian 13's kernel: uprobe-multi links, which need no `CAP_SYS_ADMIN` and are not gated by
/// `perf_event_paranoid`, left at Debian's default.
#[test]
fn debian_13_kernel_6_12() {
    if !require_root() {
        return;
    }
    let guest = Guest::boot(&Node::x86_64("kernel-trixie"), "3");
    guest.assert_release("6.12.");
    guest.assert_paranoid_at_boot(3);
    for version in haproxy::versions() {
        let label = label(3, version);
        assert_eq!(guest.route(&label), "tls: uprobe-multi links", "[{label}]\n{guest}");
        guest.assert_traced(&label, &["clear-h1", "clear-h2", "tls-h1", "tls-h2"]);
        guest.assert_no_tls_loss(&label);
    }
}

/// How the guest labels a run: `paranoid=P haproxy=V`.
fn label(paranoid: u32, version: Version) -> String {
    format!("paranoid={paranoid} haproxy={}", version.number())
}

/// What one guest printed, read from its `tracetap-guest:` lines.
struct Guest {
    console: Vec<String>,
    facts: BTreeMap<String, String>,
}

impl Guest {
    /// Boots `node` and runs the guest half with the given `perf_event_paranoid` phases. The
    /// guests of this file boot one at a time: each takes both CPUs, and its timings are not what
    /// is tested.
    fn boot(node: &Node, paranoid: &str) -> Self {
        static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
        let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let kernel_dir = node.kernel_dir;
        let kernel = tools().join(kernel_dir).join("vmlinuz");
        assert!(kernel.exists(), "{} is missing: run `make setup`", kernel.display());
        // Made for each boot and removed after it (half a gigabyte).
        let dir = tempfile::tempdir().expect("temporary directory");
        let initramfs = initramfs(dir.path(), node);
        let versions = if node.with_trixie { "2.6,3.0" } else { "2.6" };
        let console = vm::boot(
            node.machine,
            &kernel,
            &initramfs,
            "/tracetap/init",
            &format!(
                "TRACETAP_GUEST_PARANOID={paranoid} TRACETAP_GUEST_HAPROXY={versions} TRACETAP_GUEST_AS_ROOT={}",
                u8::from(node.as_root)
            ),
            Duration::from_mins(25),
        );
        // "KEY: VALUE", the key being all before the first ": " (see kernel-guest.rs).
        let facts = console
            .lines
            .iter()
            .filter_map(|l| l.split_once("tracetap-guest: ")?.1.split_once(": "))
            .map(|(key, value)| (key.to_owned(), value.to_owned()))
            .collect();
        let guest = Self { console: console.lines, facts };
        for line in guest.console.iter().filter(|l| l.contains("tracetap-guest: ")) {
            println!("[{kernel_dir}] {line}");
        }
        assert!(guest.console.iter().any(|l| l.ends_with("tracetap-guest: done")), "the guest finished\n{guest}");
        guest
    }

    fn fact(&self, key: &str) -> &str {
        self.facts.get(key).unwrap_or_else(|| panic!("the guest did not say {key:?}\n{self}"))
    }

    fn assert_release(&self, prefix: &str) {
        let release = self.fact("kernel");
        assert!(release.starts_with(prefix), "booted {release}, expected {prefix}*\n{self}");
    }

    fn assert_paranoid_at_boot(&self, level: u32) {
        assert_eq!(self.fact("paranoid-at-boot"), level.to_string(), "Debian's default\n{self}");
    }

    fn route(&self, label: &str) -> &str {
        self.fact(&format!("route {label}"))
    }

    fn metric(&self, label: &str, name: &str) -> u64 {
        let value = self.fact(&format!("metric {label} {name}"));
        value.parse().unwrap_or_else(|_| panic!("metric {name}={value}"))
    }

    /// Every request of each load in `what` (`FRONT-h1`: 100 requests, `FRONT-h2`: 200) has its
    /// SERVER span with a CLIENT span under it.
    fn assert_traced(&self, label: &str, what: &[&str]) {
        for w in what {
            let n = if w.ends_with("-h1") { 100 } else { 200 };
            let figures = self.fact(&format!("check {label} {w}"));
            assert_eq!(figures, format!("server={n} linked={n} of={n}"), "[{label}] {w}\n{self}");
        }
    }

    fn assert_no_tls_loss(&self, label: &str) {
        assert_eq!(self.metric(label, "tracetap_tls_hook_failures_total"), 0, "[{label}]\n{self}");
        assert_eq!(self.metric(label, "tracetap_events_lost_tls_unbound_total"), 0, "[{label}]\n{self}");
    }
}

impl std::fmt::Display for Guest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "guest console:")?;
        self.console.iter().try_for_each(|l| writeln!(f, "  {l}"))
    }
}

/// A node of the matrix: its machine and kernel, its root tree, and the agent and guest half
/// built for its architecture.
struct Node {
    machine: Machine,
    /// Under `.tools`: the kernel (`scripts/vm_kernel.sh`).
    kernel_dir: &'static str,
    /// Under `.tools`: the guest's root (`scripts/debootstrap_root.sh`).
    root: &'static str,
    /// Debian 13's tree goes in as `/trixie` (`HAProxy` 3.0): `x86_64` only.
    with_trixie: bool,
    /// The guest also runs the agent as root (`root haproxy=V`), after the `DaemonSet`'s runs.
    as_root: bool,
    agent: PathBuf,
    guest: PathBuf,
    /// Strips the binaries of this architecture.
    objcopy: &'static str,
}

impl Node {
    /// A PC booting `.tools/KERNEL_DIR`, with the binaries this test run uses.
    fn x86_64(kernel_dir: &'static str) -> Self {
        Self {
            machine: Machine::X86_64,
            kernel_dir,
            root: "vm-bookworm",
            with_trixie: true,
            as_root: false,
            agent: agent::binary(),
            guest: PathBuf::from(env!("CARGO_BIN_EXE_kernel-guest")),
            objcopy: "objcopy",
        }
    }

    /// An `arm64` node booting `.tools/KERNEL_DIR`, with the binaries `make cross-arm64` builds
    /// (`TRACETAP_ARM64_BIN` and `TRACETAP_ARM64_GUEST` name others).
    fn aarch64(kernel_dir: &'static str) -> Self {
        let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/aarch64-unknown-linux-gnu/release");
        let binary = |var: &str, name: &str| {
            if let Some(path) = std::env::var_os(var) {
                return PathBuf::from(path);
            }
            let path = built.join(name);
            let built_at = std::fs::metadata(&path).and_then(|m| m.modified());
            let built_at = built_at
                .unwrap_or_else(|_| panic!("{} is missing: run `make cross-arm64` (or set {var})", path.display()));
            if let Some((source, changed)) = newest_dependency(&path)
                && changed > built_at
            {
                panic!("{} is older than {source}: run `make cross-arm64` (make test does)", path.display());
            }
            path
        };
        Self {
            machine: Machine::Aarch64,
            kernel_dir,
            root: "vm-bookworm-arm64",
            with_trixie: false,
            as_root: true,
            agent: binary("TRACETAP_ARM64_BIN", "tracetap"),
            guest: binary("TRACETAP_ARM64_GUEST", "kernel-guest"),
            objcopy: "aarch64-linux-gnu-objcopy",
        }
    }
}

/// The initramfs `node` boots, made in `dir`: its Debian 12 tree as `/`, Debian 13's inside it as
/// `/trixie` where the node has it, and `/tracetap` (the agent, the guest half, and the init that
/// runs it).
fn initramfs(dir: &Path, node: &Node) -> PathBuf {
    let payload = dir.join("tracetap");
    std::fs::create_dir_all(&payload).expect("payload directory");
    // Debug information is left out (the agent's is most of its size); its symbols stay, as its
    // TLS self-test looks one up in its own file.
    for (from, name) in [(&node.agent, "tracetap"), (&node.guest, "kernel-guest")] {
        let status = std::process::Command::new(node.objcopy)
            .arg("--strip-debug")
            .arg(from)
            .arg(payload.join(name))
            .status()
            .unwrap_or_else(|e| panic!("run {} (binutils; make setup): {e}", node.objcopy));
        assert!(status.success(), "{} {}", node.objcopy, from.display());
    }
    std::fs::write(payload.join("init"), INIT).expect("write init");
    set_executable(&payload.join("init"));
    let root = tools().join(node.root);
    assert!(root.join("usr/bin/h2load").exists(), "{} is not made: run `make setup`", root.display());
    let out = dir.join("initramfs.cpio");
    if node.with_trixie {
        let trixie = haproxy::trixie_root();
        assert_eq!(trixie.file_name().and_then(|n| n.to_str()), Some("trixie"), "INIT's TRACETAP_TRIXIE_ROOT");
        vm::initramfs(&out, &[Layer::Root(&root), Layer::Under(&trixie), Layer::Under(&payload)]);
    } else {
        vm::initramfs(&out, &[Layer::Root(&root), Layer::Under(&payload)]);
    }
    out
}

/// The most recently changed of the files cargo built `binary` from (its `.d` file, which cargo
/// writes beside it; a directory there, such as the probes' sources, stands for every file in
/// it, as cargo's own check takes it), and when; `None` without that file.
fn newest_dependency(binary: &Path) -> Option<(String, std::time::SystemTime)> {
    fn newest_in(path: &Path) -> Option<(std::time::SystemTime, PathBuf)> {
        let meta = std::fs::metadata(path).ok()?;
        if !meta.is_dir() {
            return Some((meta.modified().ok()?, path.to_path_buf()));
        }
        std::fs::read_dir(path).ok()?.flatten().filter_map(|entry| newest_in(&entry.path())).max()
    }
    let deps = std::fs::read_to_string(binary.with_extension("d")).ok()?;
    let (_, files) = deps.split_once(": ")?;
    // Paths are separated by spaces; a space inside one is escaped with a backslash.
    let files = files.replace("\\ ", "\u{0}");
    files
        .split_whitespace()
        .filter_map(|f| newest_in(Path::new(&f.replace('\u{0}', " "))))
        .max()
        .map(|(changed, file)| (file.display().to_string(), changed))
}

fn set_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod init");
}

/// The guest's init: the mounts a node has, loopback up, the guest half, then power off.
///
/// The kernel's initramfs root (rootfs) cannot be `pivot_root`ed away, as the container runtime
/// of the `HAProxy` 3.0 tests does; so init first moves a bind mount of it over `/` and
/// continues chrooted into that, a root `pivot_root` can leave.
const INIT: &str = r#"#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
if [ -z "$TRACETAP_GUEST_MOVED" ]; then
    mkdir -p /.root && mount --bind / /.root && cd /.root && mount --move . / \
        && TRACETAP_GUEST_MOVED=1 exec chroot . /tracetap/init
    echo "tracetap-guest: exit: could not move the root"
    exit 1
fi
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t tracefs tracefs /sys/kernel/tracing
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up
echo "tracetap-guest: paranoid-at-boot: $(cat /proc/sys/kernel/perf_event_paranoid)"
TRACETAP_BIN=/tracetap/tracetap TRACETAP_TRIXIE_ROOT=/trixie /tracetap/kernel-guest
echo "tracetap-guest: exit: $?"
echo o > /proc/sysrq-trigger
sleep 60
"#;
