#!/usr/bin/env bash
# Validates every manifest under deploy/ against the Kubernetes OpenAPI schemas
# (kubernetes-validate, strict: unknown fields are errors) and scans the manifests and the
# Dockerfile with checkov. The checks skipped are those listed in deploy/SKIPPED_CHECKS.md, each
# with its reason; that file is the only place a skip can come from. `make test` runs this after
# `make setup` installed both tools into .tools/venv.
set -euo pipefail
cd "$(dirname "$0")"
TOOLS=${TOOLS:-../.tools/venv/bin}
K8S_VERSION=${K8S_VERSION:-1.30.0}
# Offline: no download of checkov's guideline mappings or external checks.
export BC_SKIP_MAPPING=TRUE

manifests=(kubernetes/*.yaml overlays/*/configmap.yaml)
echo "kubernetes-validate (Kubernetes $K8S_VERSION, strict): ${manifests[*]}"
"$TOOLS/kubernetes-validate" --strict --kubernetes-version "$K8S_VERSION" "${manifests[@]}"

skips=$(grep -oE '^\| `CKV[0-9A-Z_]+`' SKIPPED_CHECKS.md | tr -d '|` ' | paste -sd, -)
echo "checkov, skipping (see deploy/SKIPPED_CHECKS.md): $skips"
"$TOOLS/checkov" --quiet --compact --skip-download --framework kubernetes --directory kubernetes --skip-check "$skips"
"$TOOLS/checkov" --quiet --compact --skip-download --framework kubernetes --directory overlays --skip-check "$skips"
"$TOOLS/checkov" --quiet --compact --skip-download --framework dockerfile --file Dockerfile --skip-check "$skips"
echo "deploy/: manifests valid, security scan clean"
