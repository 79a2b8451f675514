//! Names from each traced HAProxy's own configuration: the `-f` files (and directories) on its
//! command line, read through `/proc/PID/root` so it works for HAProxy in containers. A config that
//! cannot be read or understood degrades spans to addresses, with one warning per process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracetap_proxy::haproxy_config::{self, ProxyNames};

/// Per-process names, loaded on first use.
#[derive(Debug)]
pub struct Names {
    proc_root: PathBuf,
    by_pid: HashMap<u32, Option<Arc<ProxyNames>>>,
}

impl Names {
    #[must_use]
    pub fn new(proc_root: &Path) -> Self {
        Self { proc_root: proc_root.to_owned(), by_pid: HashMap::new() }
    }

    /// The names of process `pid`'s configuration, if it could be read.
    pub fn of(&mut self, pid: u32) -> Option<Arc<ProxyNames>> {
        let root = &self.proc_root;
        self.by_pid
            .entry(pid)
            .or_insert_with(|| match load(root, pid) {
                Ok(names) => {
                    if !names.skipped.is_empty() {
                        tracing::warn!(pid, skipped = ?names.skipped, "some bind/server lines of the HAProxy configuration could not be read; those spans carry addresses only");
                    }
                    Some(Arc::new(names))
                }
                Err(reason) => {
                    tracing::warn!(pid, %reason, "cannot read the HAProxy configuration; spans carry addresses instead of frontend/backend names");
                    None
                }
            })
            .clone()
    }

    pub fn forget_process(&mut self, pid: u32) {
        self.by_pid.remove(&pid);
    }
}

/// The `-f` arguments of a command line (`-f FILE`, `-fFILE`), in order.
#[must_use]
pub fn config_paths(cmdline: &[u8]) -> Vec<String> {
    let args: Vec<&str> = cmdline.split(|b| *b == 0).filter_map(|a| std::str::from_utf8(a).ok()).collect();
    let mut out = Vec::new();
    let mut i = 1;
    while i < args.len() {
        if args[i] == "-f" {
            if let Some(p) = args.get(i + 1) {
                out.push((*p).to_owned());
            }
            i += 2;
            continue;
        }
        if let Some(p) = args[i].strip_prefix("-f").filter(|p| !p.is_empty()) {
            out.push(p.to_owned());
        }
        i += 1;
    }
    out
}

fn load(proc_root: &Path, pid: u32) -> Result<ProxyNames, String> {
    let pid_dir = proc_root.join(pid.to_string());
    let cmdline = std::fs::read(pid_dir.join("cmdline")).map_err(|e| format!("reading cmdline: {e}"))?;
    let paths = config_paths(&cmdline);
    if paths.is_empty() {
        return Err("no -f argument on the command line".into());
    }
    let cwd = std::fs::read_link(pid_dir.join("cwd")).unwrap_or_else(|_| PathBuf::from("/"));
    let root = pid_dir.join("root");
    let mut names = ProxyNames::default();
    for p in paths {
        let inside = if Path::new(&p).is_absolute() { PathBuf::from(&p) } else { cwd.join(&p) };
        let host_path = root.join(inside.strip_prefix("/").unwrap_or(&inside));
        for file in config_files(&host_path).map_err(|e| format!("{p}: {e}"))? {
            let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            names.extend(haproxy_config::parse(&text));
        }
    }
    Ok(names)
}

/// A file, or the `*.cfg` files of a directory in lexical order (as HAProxy loads them).
fn config_files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "cfg") && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_config_paths() {
        assert_eq!(
            config_paths(b"haproxy\0-f\0/etc/haproxy/haproxy.cfg\0-f\0conf.d\0-p\0/run/h.pid\0"),
            vec!["/etc/haproxy/haproxy.cfg", "conf.d"]
        );
        assert_eq!(config_paths(b"haproxy\0-f/etc/a.cfg\0-Ws\0"), vec!["/etc/a.cfg"]);
        assert!(config_paths(b"haproxy\0-f").is_empty());
    }

    #[test]
    fn loads_files_and_directories_through_proc_root() {
        let dir = std::env::temp_dir().join(format!("tracetap-names-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("conf.d")).unwrap();
        std::fs::write(dir.join("conf.d/10-fe.cfg"), "frontend fe_x\n bind 127.0.0.1:7001\n").unwrap();
        std::fs::write(dir.join("conf.d/20-be.cfg"), "backend be_x\n server s1 127.0.0.1:7002\n").unwrap();
        std::fs::write(dir.join("conf.d/ignored.txt"), "frontend nope\n bind :1\n").unwrap();
        let files = config_files(&dir.join("conf.d")).unwrap();
        assert_eq!(files.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
