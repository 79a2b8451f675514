//! The server table `HAProxy` reports through its runtime API (`show servers state`), parsed.
//!
//! The runtime API is the truth about servers at run time: slots of a `server-template` filled
//! with `set server`, servers added with `add server`, addresses that DNS resolution set. The
//! configuration file knows none of those.
//!
//! The answer is hostile input like any other: another process wrote it, and whatever listens on
//! the socket path may not be `HAProxy` at all. The parser reads the field names from the header
//! line (`# be_id be_name srv_id srv_name srv_addr ... srv_port ...`, format version 1, the same
//! in 2.6 and 3.0) rather than trusting positions, skips any line it cannot read (counted), and
//! keeps at most [`MAX_RUNTIME_SERVERS`] servers.

use std::net::IpAddr;

/// Most servers kept from one answer (ingress controllers run hundreds of backends with 42 slots
/// each by default; the names budget of [`crate::haproxy_config::MAX_NAMES_BYTES`] applies too).
pub const MAX_RUNTIME_SERVERS: usize = 100_000;

/// The one line sent: two read-only commands, which change nothing in `HAProxy`. `show info`
/// says which process answers (its `Pid`): after a reload the socket path leads to the new
/// process, whose table is not the old one's.
pub const SHOW_SERVERS_STATE: &str = "show info;show servers state\n";

/// The answer to [`SHOW_SERVERS_STATE`] cut in two: the pid `show info` gave (as the process
/// sees itself, in its own pid namespace), and the text of the server table.
#[must_use]
pub fn split_answer(answer: &str) -> (Option<u32>, &str) {
    let table_at = if answer.starts_with("1\n#") { Some(0) } else { answer.find("\n1\n#").map(|i| i + 1) };
    let (info, table) = match table_at {
        Some(i) => answer.split_at(i),
        None => (answer, ""),
    };
    let pid = info.lines().find_map(|l| l.strip_prefix("Pid:")).and_then(|v| v.trim().parse().ok());
    (pid, table)
}

/// Admin-state bits of maintenance: forced, inherited, configured (`disabled`), resolution (DNS) and
/// hostname maintenance (`srv_admin_state`, HAProxy's `SRV_ADMF_*`).
const MAINTENANCE: u32 = 0x01 | 0x02 | 0x04 | 0x20 | 0x40;

/// One server as the runtime API reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeServer {
    pub backend: String,
    pub server: String,
    pub ip: IpAddr,
    /// `None` for port 0: `HAProxy` then uses the client's destination port.
    pub port: Option<u16>,
    /// Stopped (in maintenance, or down): it takes no new connections.
    pub maintenance: bool,
}

/// A parsed `show servers state` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServersState {
    pub servers: Vec<RuntimeServer>,
    /// Lines that looked like server lines but could not be read (or came past the cap).
    pub skipped_lines: usize,
}

/// Why an answer is not a server table at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("the answer is not a `show servers state` table (format version 1): {0}")]
    NotATable(&'static str),
}

/// Parses the answer to [`SHOW_SERVERS_STATE`].
///
/// # Errors
/// When the answer does not start with format version 1 and a header naming the fields this
/// needs (`be_name`, `srv_name`, `srv_addr`, `srv_port`).
pub fn parse_servers_state(text: &str) -> Result<ServersState, StateError> {
    let mut lines = text.lines();
    if lines.next().map(str::trim) != Some("1") {
        return Err(StateError::NotATable("no format version 1 on the first line"));
    }
    let header: Vec<&str> = lines
        .next()
        .and_then(|h| h.trim().strip_prefix('#'))
        .ok_or(StateError::NotATable("no header line"))?
        .split_ascii_whitespace()
        .collect();
    let field = |name: &str| header.iter().position(|f| *f == name);
    let (Some(be), Some(srv), Some(addr), Some(port)) =
        (field("be_name"), field("srv_name"), field("srv_addr"), field("srv_port"))
    else {
        return Err(StateError::NotATable("the header lacks be_name, srv_name, srv_addr or srv_port"));
    };
    let (op, admin) = (field("srv_op_state"), field("srv_admin_state"));
    let mut out = ServersState::default();
    for line in lines {
        let line = line.trim();
        // Backends are separated by blank lines; a later header repeats nothing we need.
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if out.servers.len() >= MAX_RUNTIME_SERVERS {
            out.skipped_lines += 1;
            continue;
        }
        let fields: Vec<&str> = line.split_ascii_whitespace().collect();
        let parsed = (|| {
            let ip: IpAddr = fields.get(addr)?.parse().ok()?;
            let port: u16 = fields.get(port)?.parse().ok()?;
            let state = |i: Option<usize>| i.and_then(|i| fields.get(i)?.parse::<u32>().ok());
            // The operational state says whether it serves (0: stopped); a slot made `ready`
            // keeps the configured-maintenance bit of its `disabled` template line in its admin
            // state, so that is only read when the operational state is missing.
            let maintenance = match state(op) {
                Some(op) => op == 0,
                None => state(admin).is_some_and(|a| a & MAINTENANCE != 0),
            };
            let (backend, server) = (*fields.get(be)?, *fields.get(srv)?);
            Some(RuntimeServer {
                backend: backend.to_owned(),
                server: server.to_owned(),
                ip,
                port: (port != 0).then_some(port),
                maintenance,
            })
        })();
        match parsed {
            // An unresolved server reports no address (`-`) or the any address: nothing connects there.
            Some(s) if !s.ip.is_unspecified() => out.servers.push(s),
            Some(_) => {}
            None => out.skipped_lines += 1,
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use proptest::prelude::*;

    use super::*;

    /// As HAProxy 2.6 answers, for a `server-template SRV_ 3 127.0.0.1:1 disabled` whose second
    /// slot was set to 127.0.0.1:8081 and made ready (running, op state 2, though its admin state
    /// keeps the configured-maintenance bit 4), beside a plain server.
    const ANSWER: &str = "1\n\
# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port\n\
3 be_app 1 s0 10.0.0.5 2 0 1 1 12 1 0 2 0 0 0 0 - 8080 - 0 0 - - 0\n\
\n\
4 default_echo_8080 1 SRV_1 127.0.0.1 0 5 1 1 12 1 0 0 0 0 0 0 - 1 - 0 0 - - 0\n\
4 default_echo_8080 2 SRV_2 127.0.0.1 2 4 1 1 3 1 0 0 0 0 0 0 - 8081 - 0 0 - - 0\n\
4 default_echo_8080 3 SRV_3 127.0.0.1 0 5 1 1 12 1 0 0 0 0 0 0 - 1 - 0 0 - - 0\n\
5 be_dns 1 app1 - 0 32 1 1 12 1 0 0 0 0 0 0 app.svc 8080 - 0 0 - - 0\n";

    #[test]
    fn reads_servers_by_the_header_names() {
        let state = parse_servers_state(ANSWER).unwrap();
        let names: Vec<(&str, &str, String, Option<u16>, bool)> = state
            .servers
            .iter()
            .map(|s| (s.backend.as_str(), s.server.as_str(), s.ip.to_string(), s.port, s.maintenance))
            .collect();
        assert_eq!(
            names,
            [
                ("be_app", "s0", "10.0.0.5".into(), Some(8080), false),
                ("default_echo_8080", "SRV_1", "127.0.0.1".into(), Some(1), true),
                ("default_echo_8080", "SRV_2", "127.0.0.1".into(), Some(8081), false),
                ("default_echo_8080", "SRV_3", "127.0.0.1".into(), Some(1), true),
            ]
        );
        // The unresolved DNS server has no address: skipped as unreadable, counted.
        assert_eq!(state.skipped_lines, 1);
    }

    #[test]
    fn the_answering_pid_and_the_table_are_told_apart() {
        let answer = format!("Name: HAProxy\nVersion: 2.6.12\nPid: 7\nProcess_num: 1\n\n{ANSWER}");
        let (pid, table) = split_answer(&answer);
        assert_eq!(pid, Some(7));
        assert_eq!(parse_servers_state(table).unwrap().servers.len(), 4);
        assert_eq!(split_answer(ANSWER), (None, ANSWER));
        assert_eq!(split_answer("Pid: x\n"), (None, ""));
    }

    #[test]
    fn a_reordered_header_is_followed() {
        let text = "1\n# srv_port srv_addr srv_name be_name\n80 ::1 web be\n";
        let state = parse_servers_state(text).unwrap();
        assert_eq!(state.servers[0].server, "web");
        assert_eq!(state.servers[0].ip, "::1".parse::<IpAddr>().unwrap());
        assert_eq!(state.servers[0].port, Some(80));
        assert!(!state.servers[0].maintenance, "no admin state column: not in maintenance");
    }

    #[test]
    fn answers_that_are_not_a_table_are_refused() {
        for text in ["", "Unknown command\n", "1\n", "2\n# be_name srv_name srv_addr srv_port\n", "1\n# be_name\n"] {
            assert!(parse_servers_state(text).is_err(), "{text:?}");
        }
    }

    proptest! {
        #[test]
        fn hostile_answers_never_panic_and_stay_bounded(body in proptest::collection::vec(any::<String>(), 0..40)) {
            let text = format!("1\n# be_name srv_name srv_addr srv_port\n{}", body.join("\n"));
            let state = parse_servers_state(&text).unwrap();
            prop_assert!(state.servers.len() + state.skipped_lines <= body.iter().map(|b| b.lines().count().max(1)).sum::<usize>());
        }

        #[test]
        fn every_well_formed_line_is_read(rows in proptest::collection::vec(("[a-z_]{1,12}", "[A-Za-z0-9_]{1,12}", any::<[u8; 4]>(), 1u16..), 0..50)) {
            let mut text = String::from("1\n# be_id be_name srv_name srv_addr srv_port\n");
            for (b, s, ip, port) in &rows {
                let _ = writeln!(text, "1 {b} {s} {}.{}.{}.{} {port}", ip[0].max(1), ip[1], ip[2], ip[3]);
            }
            let state = parse_servers_state(&text).unwrap();
            prop_assert_eq!(state.servers.len(), rows.len());
            for (got, (b, s, _, port)) in state.servers.iter().zip(&rows) {
                prop_assert_eq!((&got.backend, &got.server, got.port), (b, s, Some(*port)));
            }
        }
    }
}
