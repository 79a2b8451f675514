//! Seccomp profiles as container runtimes read them, for running the agent the way a kubelet does.
//!
//! Two shapes of the same JSON are read:
//! - Docker's (moby's `profiles/seccomp/default.json`, and the copies of containerd's
//!   `RuntimeDefault` in `tests/data/seccomp`): rules may hold only for some capabilities or
//!   architectures (`includes` / `excludes`), and the runtime resolves them for the container it
//!   starts, against the container's *bounding* set;
//! - the OCI runtime spec's `LinuxSeccomp` (what `seccompProfile: Localhost` hands containerd, and
//!   what `deploy/seccomp/tracetap.json` is): a flat list, `architectures` instead of `archMap`.
//!
//! [`Profile::resolve`] does what runc and moby do to the first (a rule applies when the
//! container holds every capability it includes and none it excludes, on an architecture it
//! includes); [`Profile::apply`] loads the result with libseccomp as runc does, with one rule per
//! condition where several compare the same argument (runc's fallback), and system call names
//! unknown to this libseccomp skipped.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// A profile file, in either shape; [`Profile::resolve`] and [`flatten`] give the OCI shape
/// (no `archMap`, no `includes`/`excludes`), which is also how it is written out.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub default_action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_errno_ret: Option<i32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub arch_map: Vec<ArchMap>,
    /// The OCI shape's architectures (libseccomp names).
    #[serde(default)]
    pub architectures: Vec<String>,
    pub syscalls: Vec<Rule>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ArchMap {
    pub architecture: String,
    #[serde(default)]
    pub sub_architectures: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Rule {
    pub names: Vec<String>,
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errno_ret: Option<i32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<Arg>,
    #[serde(default, skip_serializing_if = "Filter::is_empty")]
    pub includes: Filter,
    #[serde(default, skip_serializing_if = "Filter::is_empty")]
    pub excludes: Filter,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Filter {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caps: Vec<String>,
    /// Go architecture names (`amd64`, `arm64`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub arches: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_kernel: Option<String>,
}

impl Filter {
    fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase")]
pub struct Arg {
    pub index: u32,
    pub value: u64,
    #[serde(default)]
    pub value_two: u64,
    pub op: String,
}

impl Profile {
    /// # Panics
    /// When the file is missing or not a profile.
    #[must_use]
    pub fn read(path: &Path) -> Self {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not a seccomp profile: {e}", path.display()))
    }

    /// The rules that hold for a container with bounding set `caps` (`CAP_BPF`, ...) on Go
    /// architecture `arch` (`amd64`) under kernel `kernel` (major, minor): what the kernel is
    /// given, in the OCI shape.
    #[must_use]
    pub fn resolve(&self, caps: &[&str], arch: &str, kernel: (u32, u32)) -> Profile {
        let holds = |c: &String| caps.contains(&c.as_str());
        let rules = self
            .syscalls
            .iter()
            .filter(|r| {
                !r.excludes.caps.iter().any(holds)
                    && !r.excludes.arches.iter().any(|a| a == arch)
                    && r.includes.caps.iter().all(holds)
                    && (r.includes.arches.is_empty() || r.includes.arches.iter().any(|a| a == arch))
                    && r.includes.min_kernel.as_deref().is_none_or(|k| kernel >= parse_kernel(k))
                    && r.excludes.min_kernel.as_deref().is_none_or(|k| kernel < parse_kernel(k))
            })
            .map(|r| Rule { includes: Filter::default(), excludes: Filter::default(), ..r.clone() })
            .collect();
        let native = libseccomp_arch(arch);
        let architectures = if self.arch_map.is_empty() {
            self.architectures.clone()
        } else {
            self.arch_map
                .iter()
                .filter(|m| m.architecture == native)
                .flat_map(|m| std::iter::once(m.architecture.clone()).chain(m.sub_architectures.iter().cloned()))
                .collect()
        };
        Profile {
            default_action: self.default_action.clone(),
            default_errno_ret: self.default_errno_ret,
            arch_map: Vec::new(),
            architectures,
            syscalls: rules,
        }
    }

    /// The system calls some rule of this resolved profile allows without condition on its
    /// arguments.
    #[must_use]
    pub fn allowed(&self) -> BTreeSet<&str> {
        self.syscalls
            .iter()
            .filter(|r| r.action == "SCMP_ACT_ALLOW" && r.args.is_empty())
            .flat_map(|r| r.names.iter().map(String::as_str))
            .collect()
    }

    /// Loads this resolved profile into this process (inherited across `execve`). `no_new_privs`
    /// must be set first, unless the process has `CAP_SYS_ADMIN`.
    ///
    /// # Errors
    /// What libseccomp reports, with the rule it was adding.
    pub fn apply(&self) -> Result<(), String> {
        use libseccomp::{ScmpAction, ScmpArch, ScmpArgCompare, ScmpCompareOp, ScmpFilterContext, ScmpSyscall};
        // As runc: an `SCMP_ACT_ERRNO` without its own errno is `EPERM`; `defaultErrnoRet` is
        // the default action's only.
        let action = |name: &str, errno: Option<i32>| {
            ScmpAction::from_str(name, errno.or(Some(libc::EPERM))).map_err(|e| format!("action {name}: {e}"))
        };
        let default = action(&self.default_action, self.default_errno_ret)?;
        let mut filter = ScmpFilterContext::new(default).map_err(|e| e.to_string())?;
        for arch in &self.architectures {
            let arch: ScmpArch = arch.parse().map_err(|e| format!("architecture {arch}: {e}"))?;
            filter.add_arch(arch).map_err(|e| format!("architecture {arch:?}: {e}"))?;
        }
        for rule in &self.syscalls {
            let rule_action = action(&rule.action, rule.errno_ret)?;
            if rule_action == default {
                continue; // libseccomp refuses a rule that repeats the default
            }
            let conditions = rule
                .args
                .iter()
                .map(|a| {
                    let op = match a.op.as_str() {
                        "SCMP_CMP_NE" => ScmpCompareOp::NotEqual,
                        "SCMP_CMP_LT" => ScmpCompareOp::Less,
                        "SCMP_CMP_LE" => ScmpCompareOp::LessOrEqual,
                        "SCMP_CMP_EQ" => ScmpCompareOp::Equal,
                        "SCMP_CMP_GE" => ScmpCompareOp::GreaterEqual,
                        "SCMP_CMP_GT" => ScmpCompareOp::Greater,
                        "SCMP_CMP_MASKED_EQ" => {
                            return Ok(ScmpArgCompare::new(a.index, ScmpCompareOp::MaskedEqual(a.value), a.value_two));
                        }
                        other => return Err(format!("argument operator {other}")),
                    };
                    Ok(ScmpArgCompare::new(a.index, op, a.value))
                })
                .collect::<Result<Vec<_>, String>>()?;
            let indexes: BTreeSet<u32> = rule.args.iter().map(|a| a.index).collect();
            for name in &rule.names {
                // Names this libseccomp does not know (newer calls, other architectures) are
                // skipped, as runc skips them.
                let Ok(syscall) = ScmpSyscall::from_name(name) else { continue };
                let added = if conditions.is_empty() {
                    filter.add_rule(rule_action, syscall)
                } else if indexes.len() == conditions.len() {
                    filter.add_rule_conditional(rule_action, syscall, &conditions)
                } else {
                    conditions
                        .iter()
                        .try_for_each(|c| filter.add_rule_conditional(rule_action, syscall, &[*c]).map(drop))
                        .map(|()| &mut filter)
                };
                added.map_err(|e| format!("rule for {name}: {e}"))?;
            }
        }
        filter.load().map_err(|e| format!("loading the filter: {e}"))
    }
}

/// `profile` resolved for a container with `caps` on each of `arches` (Go names), merged into one
/// flat profile: the rules of every architecture in the profile's order, each once, and the
/// architectures (with their sub-architectures) of all. A rule of one architecture only names
/// system calls that exist there, and loaders skip names unknown on the machine's.
#[must_use]
pub fn flatten(profile: &Profile, caps: &[&str], arches: &[&str], kernel: (u32, u32)) -> Profile {
    let mut flat = Profile {
        default_action: profile.default_action.clone(),
        default_errno_ret: profile.default_errno_ret,
        arch_map: Vec::new(),
        architectures: Vec::new(),
        syscalls: Vec::new(),
    };
    for arch in arches {
        let resolved = profile.resolve(caps, arch, kernel);
        for a in resolved.architectures {
            if !flat.architectures.contains(&a) {
                flat.architectures.push(a);
            }
        }
        for rule in resolved.syscalls {
            if !flat.syscalls.contains(&rule) {
                flat.syscalls.push(rule);
            }
        }
    }
    flat
}

/// libseccomp's name for a Go architecture's native ABI.
fn libseccomp_arch(go: &str) -> &'static str {
    match go {
        "amd64" => "SCMP_ARCH_X86_64",
        "arm64" => "SCMP_ARCH_AARCH64",
        "386" => "SCMP_ARCH_X86",
        "arm" => "SCMP_ARCH_ARM",
        "ppc64le" => "SCMP_ARCH_PPC64LE",
        "s390x" => "SCMP_ARCH_S390X",
        "riscv64" => "SCMP_ARCH_RISCV64",
        other => panic!("no libseccomp architecture for {other}"),
    }
}

/// This machine's Go architecture name.
#[must_use]
pub fn native_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => panic!("no Go architecture name for {other}"),
    }
}

/// The running kernel's (major, minor).
///
/// # Panics
/// When `/proc/sys/kernel/osrelease` is unreadable.
#[must_use]
pub fn kernel_version() -> (u32, u32) {
    parse_kernel(&std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release"))
}

fn parse_kernel(release: &str) -> (u32, u32) {
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// The test data directory of profiles (`tests/data/seccomp`).
#[must_use]
pub fn data_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/seccomp")
}
