#!/usr/bin/env bash
# Installs the Debian packages given as arguments that are not installed yet (`make setup`, `make
# bench`).
#
# Some machine images carry a newer qemu-utils (bookworm-backports' 10.x, installed before their
# sources were removed) than Debian 12's qemu-system-* (7.2), and it Breaks them: apt then refuses
# the whole install. The kernel matrix runs on Debian 12's qemu, so when a qemu-system package is
# wanted, an installed qemu-utils is moved to the version of Debian 12's qemu-system-common (a
# downgrade of a package nothing here needs at its newer version).
set -euo pipefail
export LC_ALL=C

missing=()
for p in "$@"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
apt-get update -q

extra=()
status=$(dpkg-query -W -f='${db:Status-Status} ${Version}' qemu-utils 2>/dev/null || true)
if [[ " ${missing[*]} " == *" qemu-system-"* && $status == "installed "* ]]; then
	installed=${status#installed }
	wanted=$(apt-cache policy qemu-system-common | awk '/Candidate:/ { print $2 }')
	if [ -n "$wanted" ] && [ "$wanted" != "(none)" ] && [ "$installed" != "$wanted" ]; then
		echo "qemu-utils $installed does not go with qemu-system-common $wanted: installing qemu-utils=$wanted"
		extra=(--allow-downgrades "qemu-utils=$wanted")
	fi
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${extra[@]}" "${missing[@]}"
