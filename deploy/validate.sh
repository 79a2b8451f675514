#!/usr/bin/env bash
# Validates every manifest under deploy/ against the Kubernetes OpenAPI schemas
# (kubernetes-validate, strict: unknown fields are errors) and scans the manifests and the
# Dockerfile with checkov: the base's files, and what `kubectl kustomize` renders for the base and
# for every overlay (with Debian's kubectl 1.20, the oldest kustomize the overlays are written for,
# so an overlay that renders only with a newer one fails here). The checks skipped are those listed
# in deploy/SKIPPED_CHECKS.md, each with its reason; that file is the only place a skip can come
# from. `make test` runs this after `make setup` installed the tools into .tools.
set -euo pipefail
cd "$(dirname "$0")"
TOOLS=${TOOLS:-../.tools/venv/bin}
K8S_VERSION=${K8S_VERSION:-1.30.0}
KUBECTL=${KUBECTL:-../.tools/kubernetes-client/usr/bin/kubectl}
# Offline: no download of checkov's guideline mappings or external checks.
export BC_SKIP_MAPPING=TRUE

rendered=$(mktemp -d)
trap 'rm -rf "$rendered"' EXIT
echo "kubectl kustomize ($("$KUBECTL" version --client --short 2>/dev/null || "$KUBECTL" version --client)): kubernetes overlays/*"
for dir in kubernetes overlays/*/; do
	name=$(basename "$dir")
	"$KUBECTL" kustomize "$dir" >"$rendered/$name.yaml" || { echo "kubectl kustomize $dir failed"; exit 1; }
	kinds=$(grep -c '^kind:' "$rendered/$name.yaml")
	echo "  $dir: $kinds objects"
done

manifests=(kubernetes/*.yaml "$rendered"/*.yaml)
echo "kubernetes-validate (Kubernetes $K8S_VERSION, strict): ${manifests[*]}"
"$TOOLS/kubernetes-validate" --strict --kubernetes-version "$K8S_VERSION" "${manifests[@]}"

# Rows `| \`CKV_...\` |` skip a check everywhere; rows `| \`overlay\` | \`CKV_...\` |` only in what
# that overlay renders.
skips=$(grep -oE '^\| `CKV[0-9A-Z_]+`' SKIPPED_CHECKS.md | tr -d '|` ' | paste -sd, -)
echo "checkov, skipping (see deploy/SKIPPED_CHECKS.md): $skips"
"$TOOLS/checkov" --quiet --compact --skip-download --framework kubernetes --directory kubernetes --skip-check "$skips"
for file in "$rendered"/*.yaml; do
	name=$(basename "$file" .yaml)
	only_here=$(grep -oE "^\| \`$name\` \| \`CKV[0-9A-Z_]+\`" SKIPPED_CHECKS.md | grep -oE "CKV[0-9A-Z_]+" | paste -sd, - || true)
	[ -z "$only_here" ] || echo "checkov, $name: also skipping $only_here"
	"$TOOLS/checkov" --quiet --compact --skip-download --framework kubernetes --file "$file" --skip-check "$skips${only_here:+,$only_here}"
done
"$TOOLS/checkov" --quiet --compact --skip-download --framework dockerfile --file Dockerfile --skip-check "$skips"
echo "deploy/: manifests and rendered overlays valid, security scan clean"
