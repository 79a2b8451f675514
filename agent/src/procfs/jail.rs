//! The directories above a process's root: where a process that `chroot`ed itself (HAProxy's
//! `chroot` directive, `chroot /var/lib/haproxy` in Debian's packaged configuration) started, and
//! where `/proc/PID/maps` names its libraries from. `..` of `/proc/PID/root` follows the process's
//! own mounts, so the walk stays within its mount namespace (or the agent's root, when they share
//! one) and stops where `..` goes no higher.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

/// How many directories above its root a process's namespace top may be looked for.
pub const MAX_DEPTH: usize = 16;

/// `root` (a `/proc/PID/root`) followed by `..` once, twice, ... nearest first, up to the top of
/// the process's mount namespace or [`MAX_DEPTH`] levels. Paths rather than descriptors, so that
/// they can be handed on (aya opens a library by path); empty when `root` is the top.
#[must_use]
pub fn above(root: &Path) -> Vec<PathBuf> {
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let mut out = Vec::new();
    let (mut here, Some(mut here_id)) = (root.to_path_buf(), id(root)) else { return out };
    for _ in 0..MAX_DEPTH {
        let up = here.join("..");
        match id(&up) {
            Some(up_id) if up_id != here_id => {
                out.push(up.clone());
                (here, here_id) = (up, up_id);
            }
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_above_a_root_nearest_first_up_to_the_top() {
        let tree = tempfile::tempdir().unwrap();
        let jail = tree.path().join("var/lib/haproxy");
        std::fs::create_dir_all(&jail).unwrap();
        let above = above(&jail);
        assert_eq!(above[0], jail.join(".."));
        assert!(above.iter().any(|d| std::fs::canonicalize(d).unwrap() == tree.path().canonicalize().unwrap()));
        assert_eq!(std::fs::canonicalize(above.last().unwrap()).unwrap(), Path::new("/"), "ends at the top");
        assert!(super::above(Path::new("/")).is_empty(), "nothing above the top");
    }
}
