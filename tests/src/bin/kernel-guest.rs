//! The guest half of the kernel matrix (`tests/tests/kernels.rs`): the program a VM booted from a
//! Debian kernel runs, which prints what it saw as `tracetap-guest:` lines on the console for the
//! host half to check. It asserts nothing itself: what each kernel must give is said on the host.
//!
//! For each `kernel.perf_event_paranoid` value in `TRACETAP_GUEST_PARANOID` (comma-separated; the
//! kernel hands its command line's `NAME=value` words to init as environment) and each `HAProxy`
//! version (`TRACETAP_GUEST_HAPROXY`, see [`versions`]), one run of
//! `tracetap_tests::kernel_matrix` with the agent under exactly the `DaemonSet`'s four
//! capabilities, labelled `paranoid=P haproxy=V`; with `TRACETAP_GUEST_AS_ROOT=1`, one more per
//! version with the agent as root, labelled `root haproxy=V`. Lines:
//!
//! ```text
//! tracetap-guest: kernel: RELEASE
//! tracetap-guest: machine: MACHINE                 (`uname -m`)
//! tracetap-guest: KEY: VALUE                       (each fact of each run)
//! tracetap-guest: done
//! ```

use tracetap_tests::agent::Agent;
use tracetap_tests::haproxy::{self, Version};
use tracetap_tests::kernel_matrix;

fn main() {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    say("kernel", release.trim());
    let machine = std::process::Command::new("uname").arg("-m").output().map(|o| o.stdout).unwrap_or_default();
    say("machine", String::from_utf8_lossy(&machine).trim());
    let phases = std::env::var("TRACETAP_GUEST_PARANOID").unwrap_or_default();
    for paranoid in phases.split(',').filter(|p| !p.is_empty()) {
        std::fs::write("/proc/sys/kernel/perf_event_paranoid", paranoid).expect("set kernel.perf_event_paranoid");
        for version in versions() {
            let label = format!("paranoid={paranoid} haproxy={}", version.number());
            kernel_matrix::run(&label, version, Agent::start_with_daemonset_capabilities, &mut |k, v| say(&k, &v));
        }
    }
    if std::env::var("TRACETAP_GUEST_AS_ROOT").as_deref() == Ok("1") {
        for version in versions() {
            let label = format!("root haproxy={}", version.number());
            kernel_matrix::run(&label, version, Agent::start, &mut |k, v| say(&k, &v));
        }
    }
    say("done", "");
}

/// The `HAProxy` versions to run: those named in `TRACETAP_GUEST_HAPROXY` (comma-separated,
/// `2.6` or `3.0`; the arm64 guest has no Debian 13 tree), else both.
fn versions() -> Vec<Version> {
    match std::env::var("TRACETAP_GUEST_HAPROXY") {
        Ok(names) if !names.is_empty() => {
            haproxy::versions().into_iter().filter(|v| names.split(',').any(|n| n == v.number())).collect()
        }
        _ => haproxy::versions().to_vec(),
    }
}

fn say(key: &str, value: &str) {
    if value.is_empty() {
        println!("tracetap-guest: {key}");
    } else {
        println!("tracetap-guest: {key}: {value}");
    }
}
