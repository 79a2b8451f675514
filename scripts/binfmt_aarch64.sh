#!/usr/bin/env bash
# Lets this x86_64 host run aarch64 programs through qemu-user-static, which debootstrap needs for
# the second stage of an arm64 tree (scripts/debootstrap_root.sh ... arm64): mounts binfmt_misc
# if it is not, and registers qemu-aarch64 from the package's own binfmt.d entry. The
# registration is the host's, for every process. It needs the F flag (the interpreter opened now,
# so that it also runs inside the tree's chroot, where its path does not exist): an entry without
# it, left by another tool, is replaced. Idempotent.
set -euo pipefail
binfmt=/proc/sys/fs/binfmt_misc
[ -e "$binfmt/register" ] || mount -t binfmt_misc binfmt_misc "$binfmt"
if [ -e "$binfmt/qemu-aarch64" ]; then
	grep -q '^flags: .*F' "$binfmt/qemu-aarch64" && exit 0
	echo "replacing the qemu-aarch64 entry of binfmt_misc, which lacks the F flag"
	echo -1 >"$binfmt/qemu-aarch64"
fi
entry=/usr/lib/binfmt.d/qemu-aarch64.conf
[ -s "$entry" ] || { echo "$entry is missing: install qemu-user-static"; exit 1; }
cat "$entry" >"$binfmt/register"
echo "registered qemu-aarch64 with binfmt_misc"
