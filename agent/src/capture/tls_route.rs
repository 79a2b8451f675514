//! The one message the agent gives when no route of [`super::uprobes`] can attach the TLS
//! probes: the kernel, what refused each route, and what would fix it. A pure function of what
//! the self-tests saw, so that each cause is tested without the kernel refusing for real.

use std::io;

use super::uprobes::{TracefsError, TracefsStep};

/// What a route's self-test met.
#[derive(Debug)]
pub enum Refusal<'a, E> {
    /// `TRACETAP_TLS_ROUTE` names another route.
    NotTried,
    /// The attach itself failed: its error says something of the kernel or the privileges.
    Attach(&'a E),
    /// Something before the attach failed (loading the programs, the verifier): said as it is.
    Other(String),
}

/// What each route's self-test met.
#[derive(Debug)]
pub struct Refusals<'a> {
    pub kernel: String,
    /// The uprobe-multi link (`BPF_LINK_CREATE`).
    pub multi: Refusal<'a, io::Error>,
    /// aya's perf uprobe attach.
    pub perf: Refusal<'a, String>,
    /// The tracefs event, or `None` (with [`Refusal::Other`] unused) when no tracefs with
    /// `uprobe_events` is mounted.
    pub tracefs: Option<Refusal<'a, TracefsError>>,
    /// `kernel.perf_event_paranoid`, when readable.
    pub perf_event_paranoid: Option<i32>,
    /// A seccomp filter applies to the agent.
    pub seccomp: bool,
    /// The value of `TRACETAP_TLS_ROUTE` when it names one route.
    pub forced: Option<&'a str>,
}

/// The message: one line, every route with its cause, then the fixes that apply.
#[must_use]
pub fn no_route_message(r: &Refusals<'_>) -> String {
    let mut fixes: Vec<String> = Vec::new();
    let not_tried = || format!("not tried (TRACETAP_TLS_ROUTE={})", r.forced.unwrap_or("auto"));
    if let Some(route) = r.forced {
        fixes.push(format!("unset TRACETAP_TLS_ROUTE (it is {route}), so that the agent tries every route"));
    }
    let multi = match &r.multi {
        Refusal::NotTried => not_tried(),
        Refusal::Other(text) => text.clone(),
        Refusal::Attach(e) => match e.raw_os_error() {
            Some(libc::EINVAL | libc::EOPNOTSUPP) => "this kernel has none (they came in Linux 6.6)".to_owned(),
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => {
                if r.seccomp {
                    fixes.push(
                        "use a seccomp profile that allows bpf() and perf_event_open() (deploy/seccomp/tracetap.json, docs/deploy.md)"
                            .to_owned(),
                    );
                }
                fixes.push(
                    "grant CAP_BPF and CAP_PERFMON (uprobe-multi links need nothing more, on Linux 6.6+)".to_owned(),
                );
                format!("refused ({e})")
            }
            _ => e.to_string(),
        },
    };
    let perf = match &r.perf {
        Refusal::NotTried => not_tried(),
        Refusal::Other(text) => text.clone(),
        Refusal::Attach(text) => {
            format!("{text} (Linux requires CAP_SYS_ADMIN for them since commit ba677dbe77af)")
        }
    };
    let tracefs = match &r.tracefs {
        None => {
            fixes.push(
                "on kernels without uprobe-multi links, mount the host's /sys/kernel/tracing into the agent's pod, writable (deploy/overlays/tracefs)"
                    .to_owned(),
            );
            "tracefs is not mounted where the agent looks (/sys/kernel/tracing, /sys/kernel/debug/tracing)".to_owned()
        }
        Some(Refusal::NotTried) => not_tried(),
        Some(Refusal::Other(text)) => text.clone(),
        Some(Refusal::Attach(e)) => tracefs_refusal(e, r.perf_event_paranoid, &mut fixes),
    };
    fixes.push(
        "as a last resort, add CAP_SYS_ADMIN to the agent container's capabilities, which perf uprobes need".to_owned(),
    );
    format!(
        "TLS connections cannot be traced on this node (Linux {}): uprobe-multi links: {multi}; perf uprobes: {perf}; tracefs uprobe events: {tracefs}. To fix, any one of: {}. Cleartext connections are traced as usual.",
        r.kernel,
        fixes.join("; ")
    )
}

/// What refused the tracefs route, with the fix it calls for.
fn tracefs_refusal(e: &TracefsError, paranoid: Option<i32>, fixes: &mut Vec<String>) -> String {
    let denied = matches!(e.error.raw_os_error(), Some(libc::EACCES | libc::EPERM));
    match e.step {
        TracefsStep::Open if denied => match paranoid {
            Some(level) if level > 2 => {
                fixes.push(format!(
                    "set kernel.perf_event_paranoid to 2 on the node (it is {level}; `sysctl -w kernel.perf_event_paranoid=2`, or a file in /etc/sysctl.d)"
                ));
                format!("{e}, with kernel.perf_event_paranoid at {level}")
            }
            _ => e.to_string(),
        },
        TracefsStep::Write if denied || e.error.raw_os_error() == Some(libc::EROFS) => {
            fixes.push(
                "mount the host's /sys/kernel/tracing writable into the agent's pod, and run the agent as uid 0"
                    .to_owned(),
            );
            e.to_string()
        }
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    fn message(multi: &io::Error, tracefs: Option<&TracefsError>, paranoid: i32, seccomp: bool) -> String {
        no_route_message(&Refusals {
            kernel: "6.1.0-50-amd64".to_owned(),
            multi: Refusal::Attach(multi),
            perf: Refusal::Attach(&"Permission denied (os error 13)".to_owned()),
            tracefs: Some(tracefs.map_or(Refusal::NotTried, Refusal::Attach)),
            perf_event_paranoid: Some(paranoid),
            seccomp,
            forced: None,
        })
    }

    #[test]
    fn debian_12s_default_paranoia_names_the_setting_and_its_value() {
        let refused = TracefsError { step: TracefsStep::Open, error: os(libc::EACCES) };
        let m = message(&os(libc::EINVAL), Some(&refused), 3, false);
        assert!(m.contains("Linux 6.1.0-50-amd64"), "{m}");
        assert!(m.contains("this kernel has none (they came in Linux 6.6)"), "{m}");
        assert!(m.contains("kernel.perf_event_paranoid at 3"), "{m}");
        assert!(m.contains("set kernel.perf_event_paranoid to 2"), "{m}");
        assert!(m.contains("ba677dbe77af"), "{m}");
        assert!(!m.contains("deploy/overlays/tracefs"), "tracefs is there: {m}");
    }

    #[test]
    fn no_tracefs_asks_for_the_mount() {
        let m = no_route_message(&Refusals {
            kernel: "6.1.0-50-amd64".to_owned(),
            multi: Refusal::Attach(&os(libc::EINVAL)),
            perf: Refusal::Attach(&"Permission denied (os error 13)".to_owned()),
            tracefs: None,
            perf_event_paranoid: Some(2),
            seccomp: false,
            forced: None,
        });
        assert!(m.contains("tracefs is not mounted"), "{m}");
        assert!(m.contains("deploy/overlays/tracefs"), "{m}");
        assert!(!m.contains("perf_event_paranoid to 2"), "{m}");
    }

    #[test]
    fn a_seccomp_refusal_points_at_the_profile() {
        let m = message(&os(libc::EPERM), None, 2, true);
        assert!(m.contains("seccomp profile"), "{m}");
        assert!(m.contains("CAP_BPF and CAP_PERFMON"), "{m}");
    }

    #[test]
    fn a_read_only_tracefs_asks_for_a_writable_one() {
        let refused = TracefsError { step: TracefsStep::Write, error: os(libc::EROFS) };
        let m = message(&os(libc::EINVAL), Some(&refused), 2, false);
        assert!(m.contains("writable"), "{m}");
    }

    #[test]
    fn a_verifier_refusal_is_said_as_it_is_not_taken_for_an_old_kernel() {
        let m = no_route_message(&Refusals {
            kernel: "6.12.117-amd64".to_owned(),
            multi: Refusal::Other(
                "loading ssl_read_call for uprobe-multi links: Invalid argument (verifier: R1 invalid mem access)"
                    .to_owned(),
            ),
            perf: Refusal::NotTried,
            tracefs: Some(Refusal::NotTried),
            perf_event_paranoid: Some(2),
            seccomp: false,
            forced: Some("uprobe_multi"),
        });
        assert!(m.contains("verifier: R1 invalid mem access"), "{m}");
        assert!(!m.contains("they came in Linux 6.6"), "{m}");
        assert!(m.contains("not tried (TRACETAP_TLS_ROUTE=uprobe_multi)"), "{m}");
        assert!(m.contains("unset TRACETAP_TLS_ROUTE"), "{m}");
        assert!(!m.contains("since commit ba677dbe77af"), "perf was not tried: {m}");
    }
}
