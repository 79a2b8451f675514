#!/usr/bin/env bash
# Makes a minimal Debian tree for the tests that run things the way containers run them:
#   scripts/debootstrap_root.sh DIR SUITE [PACKAGES [ARCH]]
# e.g. `.tools/trixie trixie haproxy` (HAProxy 3.0's container root) or `.tools/image bookworm`
# (the agent's image base, as deploy/Dockerfile's debian:bookworm-slim has it). A foreign ARCH
# (`arm64`) runs its second stage through qemu-user-static, which must be registered with
# binfmt_misc first (scripts/binfmt_aarch64.sh). Idempotent: a tree
# that has DIR/.complete is kept. Built in DIR.partial and renamed when complete, so an interrupted
# run starts over; mounts left inside an incomplete tree by a killed test are detached first.
set -euo pipefail
dir=$1 suite=$2 packages=${3:-} arch=${4:-}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ -e "$dir/.complete" ] && exit 0
for d in "$dir.partial" "$dir"; do
	[ -e "$d" ] || continue
	echo "removing incomplete $d"
	awk -v d="$d/" 'index($2 "/", d) == 1 { print $2 }' /proc/self/mounts | sort -r | xargs -r -n1 umount -l
	rm -rf --one-file-system "$d"
done
echo "debootstrap: Debian $suite${arch:+ ($arch)}${packages:+ with $packages} into $dir"
mkdir -p "$(dirname "$dir")"
if ! debootstrap --variant=minbase ${arch:+--arch=$arch} ${packages:+--include=$packages} "$suite" "$dir.partial" "$mirror" >"$dir.log" 2>&1; then
	echo "debootstrap failed; its log: $dir.log"
	tail -n 20 "$dir.log"
	exit 1
fi
touch "$dir.partial/.complete"
mv "$dir.partial" "$dir"
