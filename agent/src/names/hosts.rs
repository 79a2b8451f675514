//! A process's `/etc/hosts`, as its resolver reads it: for `server` lines that give a hostname.
//!
//! Format (hosts(5)): one address per line followed by its names, `#` starts a comment. The first
//! line that names a host gives its address, as glibc's `files` source answers. Names compare
//! without regard to case. Lines that do not read are skipped.

use std::collections::HashMap;
use std::net::IpAddr;

/// Most names kept (the file is read within a byte cap too).
pub(crate) const MAX_HOST_NAMES: usize = 65_536;

/// Hostname (lower case) to address.
#[must_use]
pub(crate) fn parse_hosts(text: &str) -> HashMap<String, IpAddr> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("");
        let mut fields = line.split_ascii_whitespace();
        let Some(ip) = fields.next().and_then(|a| a.parse::<IpAddr>().ok()) else { continue };
        for name in fields {
            if out.len() >= MAX_HOST_NAMES {
                return out;
            }
            out.entry(name.to_ascii_lowercase()).or_insert(ip);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn first_line_naming_a_host_wins_and_case_does_not_matter() {
        let hosts = parse_hosts(
            "127.0.0.1\tlocalhost\n::1 localhost ip6-localhost # loopback\n\
             # 10.9.9.9 commented.out\n10.0.0.7 App.Default.svc app\n10.0.0.8 app\nnot-an-ip name\n",
        );
        assert_eq!(hosts["localhost"], "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!(hosts["ip6-localhost"], "::1".parse::<IpAddr>().unwrap());
        assert_eq!(hosts["app.default.svc"], "10.0.0.7".parse::<IpAddr>().unwrap());
        assert_eq!(hosts["app"], "10.0.0.7".parse::<IpAddr>().unwrap());
        assert!(!hosts.contains_key("commented.out") && !hosts.contains_key("name"));
    }

    proptest! {
        #[test]
        fn hostile_files_never_panic(text in "\\PC{0,400}") {
            let hosts = parse_hosts(&text);
            prop_assert!(hosts.len() <= MAX_HOST_NAMES);
        }
    }
}
