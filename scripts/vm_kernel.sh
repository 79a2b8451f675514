#!/usr/bin/env bash
# Fetches the kernel a Debian release's nodes boot (the image package `linux-image-amd64` depends
# on) and unpacks its vmlinuz, for the kernel matrix (tests/tests/kernels.rs boots it under qemu):
#   scripts/vm_kernel.sh DIR SUITE [ARCH]   e.g. `.tools/kernel-bookworm bookworm`, or
#   `.tools/kernel-bookworm-arm64 bookworm arm64` (`linux-image-arm64`, for the arm64 guest).
# Uses apt with a private source list and state, so any release's kernel can be fetched from this
# host without touching its apt configuration. Nothing is installed: no postinst, no initramfs (the
# test boots with its own). Idempotent: DIR/vmlinuz and DIR/release are kept once made.
set -euo pipefail
dir=$1 suite=$2 arch=${3:-amd64}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[ -s "$dir/vmlinuz" ] && [ -s "$dir/release" ] && exit 0
tmp=$(mktemp -d)
chmod 755 "$tmp" # apt downloads as _apt
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/lists/partial" "$tmp/cache/archives/partial" "$tmp/etc/preferences.d" "$tmp/etc/sources.list.d"
echo "deb $mirror $suite main" >"$tmp/etc/sources.list"
apt=(-o "Dir::Etc::SourceList=$tmp/etc/sources.list" -o "Dir::Etc::SourceParts=$tmp/etc/sources.list.d"
	-o "Dir::Etc::PreferencesParts=$tmp/etc/preferences.d" -o "Dir::State::Lists=$tmp/lists"
	-o "Dir::Cache=$tmp/cache" -o "APT::Architecture=$arch" -o "APT::Architectures=$arch")
echo "fetching Debian $suite's linux-image-$arch into $dir"
apt-get -q "${apt[@]}" update >"$tmp/update.log" 2>&1 || { cat "$tmp/update.log"; exit 1; }
package=$(apt-cache "${apt[@]}" depends "linux-image-$arch" | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }')
[ -n "$package" ] || { echo "no kernel package behind linux-image-$arch in $suite"; exit 1; }
(cd "$tmp" && apt-get -q "${apt[@]}" download "$package" >/dev/null)
dpkg-deb -x "$tmp/${package}"_*.deb "$tmp/unpacked"
mkdir -p "$dir"
cp "$tmp"/unpacked/boot/vmlinuz-* "$dir/vmlinuz.partial"
mv "$dir/vmlinuz.partial" "$dir/vmlinuz"
basename "$tmp"/unpacked/boot/vmlinuz-* | sed 's/^vmlinuz-//' >"$dir/release"
echo "$dir: $(cat "$dir/release")"
