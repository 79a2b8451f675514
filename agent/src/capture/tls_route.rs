//! The one message the agent gives when no route of [`super::uprobes`] can attach the TLS
//! probes: the kernel, what refused each route, and what would fix it. A pure function of what
//! the self-tests saw, so that each cause is tested without the kernel refusing for real.

use std::io;

use super::uprobes::{TracefsError, TracefsStep};

/// What each route's self-test met.
#[derive(Debug)]
pub struct Refusals<'a> {
    pub kernel: String,
    /// The uprobe-multi link (or the program load for it).
    pub multi: &'a io::Error,
    /// aya's perf uprobe attach.
    pub perf: String,
    /// The tracefs event, or `None` when no tracefs with `uprobe_events` is mounted.
    pub tracefs: Option<&'a TracefsError>,
    /// `kernel.perf_event_paranoid`, when readable.
    pub perf_event_paranoid: Option<i32>,
    /// A seccomp filter applies to the agent.
    pub seccomp: bool,
}

/// The message: one line, every route with its cause, then the fixes that apply.
#[must_use]
pub fn no_route_message(r: &Refusals<'_>) -> String {
    let mut fixes: Vec<String> = Vec::new();
    let errno = |e: &io::Error| e.raw_os_error();
    let multi = match errno(r.multi) {
        Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS) if !r.seccomp || errno(r.multi) == Some(libc::EINVAL) => {
            "this kernel has none (they came in Linux 6.6)".to_owned()
        }
        Some(libc::EPERM | libc::EACCES) => {
            fixes
                .push("grant CAP_BPF and CAP_PERFMON (uprobe-multi links need nothing more, on Linux 6.6+)".to_owned());
            format!("refused ({})", r.multi)
        }
        _ => r.multi.to_string(),
    };
    if r.seccomp && matches!(errno(r.multi), Some(libc::EPERM | libc::ENOSYS)) {
        fixes.push(
            "use a seccomp profile that allows bpf() and perf_event_open() (deploy/seccomp/tracetap.json, the README's Kubernetes section)"
                .to_owned(),
        );
    }
    let tracefs = match r.tracefs {
        None => {
            fixes.push(
                "on kernels without uprobe-multi links, mount the host's /sys/kernel/tracing into the agent's pod (a hostPath volume, as deploy/kubernetes has it)"
                    .to_owned(),
            );
            "tracefs is not mounted where the agent looks (/sys/kernel/tracing, /sys/kernel/debug/tracing)".to_owned()
        }
        Some(e) if e.step == TracefsStep::Open && matches!(errno(&e.error), Some(libc::EACCES | libc::EPERM)) => {
            match r.perf_event_paranoid {
                Some(level) if level > 2 => {
                    fixes.push(format!(
                        "set kernel.perf_event_paranoid to 2 on the node (it is {level}; `sysctl -w kernel.perf_event_paranoid=2`, or a sysctl file in /etc/sysctl.d)"
                    ));
                    format!("{e}, with kernel.perf_event_paranoid at {level}")
                }
                _ => e.to_string(),
            }
        }
        Some(e)
            if e.step == TracefsStep::Write
                && matches!(errno(&e.error), Some(libc::EACCES | libc::EPERM | libc::EROFS)) =>
        {
            fixes.push(
                "mount the host's /sys/kernel/tracing writable into the agent's pod, and run the agent as uid 0"
                    .to_owned(),
            );
            e.to_string()
        }
        Some(e) => e.to_string(),
    };
    fixes.push(
        "as a last resort, add CAP_SYS_ADMIN to the agent container's capabilities, which perf uprobes need".to_owned(),
    );
    format!(
        "TLS connections cannot be traced on this node (Linux {}): uprobe-multi links: {multi}; perf uprobes: {} (Linux requires CAP_SYS_ADMIN for them since commit ba677dbe77af); tracefs uprobe events: {tracefs}. To fix, any one of: {}. Cleartext connections are traced as usual.",
        r.kernel,
        r.perf,
        fixes.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    fn message(multi: i32, tracefs: Option<&TracefsError>, paranoid: i32, seccomp: bool) -> String {
        no_route_message(&Refusals {
            kernel: "6.1.0-50-amd64".to_owned(),
            multi: &os(multi),
            perf: "Permission denied (os error 13)".to_owned(),
            tracefs,
            perf_event_paranoid: Some(paranoid),
            seccomp,
        })
    }

    #[test]
    fn debian_12s_default_paranoia_names_the_setting_and_its_value() {
        let refused = TracefsError { step: TracefsStep::Open, error: os(libc::EACCES) };
        let m = message(libc::EINVAL, Some(&refused), 3, false);
        assert!(m.contains("Linux 6.1.0-50-amd64"), "{m}");
        assert!(m.contains("this kernel has none (they came in Linux 6.6)"), "{m}");
        assert!(m.contains("kernel.perf_event_paranoid at 3"), "{m}");
        assert!(m.contains("set kernel.perf_event_paranoid to 2"), "{m}");
        assert!(m.contains("ba677dbe77af"), "{m}");
        assert!(!m.contains("hostPath"), "tracefs is there: {m}");
    }

    #[test]
    fn no_tracefs_asks_for_the_mount() {
        let m = message(libc::EINVAL, None, 2, false);
        assert!(m.contains("tracefs is not mounted"), "{m}");
        assert!(m.contains("hostPath"), "{m}");
        assert!(!m.contains("perf_event_paranoid to 2"), "{m}");
    }

    #[test]
    fn a_seccomp_refusal_points_at_the_profile() {
        let m = message(libc::EPERM, None, 2, true);
        assert!(m.contains("seccomp profile"), "{m}");
        assert!(m.contains("CAP_BPF and CAP_PERFMON"), "{m}");
    }

    #[test]
    fn a_read_only_tracefs_asks_for_a_writable_one() {
        let refused = TracefsError { step: TracefsStep::Write, error: os(libc::EROFS) };
        let m = message(libc::EINVAL, Some(&refused), 2, false);
        assert!(m.contains("writable"), "{m}");
    }
}
