//! Where a traced process keeps its TLS library: the files it maps that may export `SSL_read`,
//! `SSL_write` and `SSL_do_handshake` (a shared `libssl`, or the program itself when it links
//! `OpenSSL`, `AWS-LC` or `BoringSSL` statically), as paths the agent can open from its own mount
//! namespace (through `/proc/PID/root`, so a process in a container is covered).
//!
//! The probes themselves are attached by [`super::loader::Probes::hook_tls`], one set per process
//! (never for every process that maps the same library: other programs on the node must not pay a
//! uprobe per TLS call), and detached when the process goes.

use std::collections::BTreeSet;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use procfs_core::FromBufRead as _;
use procfs_core::process::{MMPermissions, MMapPath, MemoryMaps};

/// The functions probed, with the entry and return programs attached to each. The handshake is
/// probed so that a connection is bound to its socket before its first plaintext (see the probes'
/// `tls` module).
pub const FUNCTIONS: [(&str, &str, &str); 3] = [
    ("SSL_do_handshake", "ssl_handshake_entry", "ssl_handshake_return"),
    ("SSL_read", "ssl_read_entry", "ssl_read_return"),
    ("SSL_write", "ssl_write_entry", "ssl_write_return"),
];

/// Files mapped executable by the process that may hold the TLS functions: every `libssl*`, and
/// the program itself (a static build), each once with the inode the mapping names. Paths are as
/// `/proc/PID/maps` shows them to the agent.
#[must_use]
pub fn candidate_objects(maps: &MemoryMaps, exe: Option<&Path>) -> Vec<(PathBuf, u64)> {
    let mut out: BTreeSet<(PathBuf, u64)> = BTreeSet::new();
    for map in maps {
        let MMapPath::Path(path) = &map.pathname else { continue };
        if !map.perms.contains(MMPermissions::EXECUTE) {
            continue;
        }
        let is_libssl = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libssl"));
        if is_libssl || exe == Some(path.as_path()) {
            out.insert((path.clone(), map.inode));
        }
    }
    // The program first: a static build answers there and no library is needed.
    let (mut ordered, rest): (Vec<_>, Vec<_>) = out.into_iter().partition(|(p, _)| Some(p.as_path()) == exe);
    ordered.extend(rest);
    ordered
}

/// [`candidate_objects`] of process `pid`, as paths the agent can open. `/proc/PID/maps` shows a
/// path from the reader's root when it can (a chroot on the host's mounts: the host path), else
/// from the process's own mount namespace (a container: the path inside it). So the path is tried
/// under `/proc/PID/root` first, then as it is, and kept only where its inode is the mapping's.
pub fn objects_of(proc_root: &Path, pid: u32) -> std::io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt as _;
    let dir = proc_root.join(pid.to_string());
    let file = std::fs::File::open(dir.join("maps"))?;
    let maps = MemoryMaps::from_buf_read(BufReader::new(file)).map_err(std::io::Error::other)?;
    let exe = std::fs::read_link(dir.join("exe")).ok();
    let root = dir.join("root");
    Ok(candidate_objects(&maps, exe.as_deref())
        .into_iter()
        .filter_map(|(path, inode)| {
            [root.join(path.strip_prefix("/").unwrap_or(&path)), path]
                .into_iter()
                .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == inode))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0050000 r--p 00000000 fe:01 1311 /usr/sbin/haproxy
55d0c0050000-55d0c0250000 r-xp 00050000 fe:01 1311 /usr/sbin/haproxy
7f0000000000-7f0000020000 r--p 00000000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000020000-7f0000080000 r-xp 00020000 fe:01 2001 /usr/lib/x86_64-linux-gnu/libssl.so.3
7f0000100000-7f0000300000 r-xp 00020000 fe:01 2002 /usr/lib/x86_64-linux-gnu/libcrypto.so.3
7f0000400000-7f0000401000 rw-p 00000000 00:00 0 [heap]
7f0000500000-7f0000501000 r--p 00000000 fe:01 2003 /opt/libssl-notes.txt
";

    fn maps(text: &str) -> MemoryMaps {
        MemoryMaps::from_buf_read(text.as_bytes()).unwrap()
    }

    #[test]
    fn the_program_then_each_executable_libssl_once() {
        let found = candidate_objects(&maps(MAPS), Some(Path::new("/usr/sbin/haproxy")));
        assert_eq!(
            found,
            [
                (PathBuf::from("/usr/sbin/haproxy"), 1311),
                (PathBuf::from("/usr/lib/x86_64-linux-gnu/libssl.so.3"), 2001)
            ]
        );
    }

    #[test]
    fn without_a_readable_program_only_libraries() {
        let found = candidate_objects(&maps(MAPS), None);
        assert_eq!(found, [(PathBuf::from("/usr/lib/x86_64-linux-gnu/libssl.so.3"), 2001)]);
    }

    #[test]
    fn objects_are_reached_through_the_process_root() {
        let pid = std::process::id();
        let found = objects_of(Path::new("/proc"), pid).unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let expected = Path::new("/proc").join(pid.to_string()).join("root").join(exe.strip_prefix("/").unwrap());
        assert_eq!(found.first(), Some(&expected), "the test binary maps itself executable");
    }
}
