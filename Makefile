# tracetap: `make demo` shows spans from a local HAProxy; `make test` runs every test.
# Both install what is missing first (`make setup`, idempotent; needs root on Debian 12).

SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)

APT_PACKAGES := haproxy wrk curl openssl nghttp2-client pkg-config llvm-22-dev libpolly-22-dev libzstd-dev python3-venv debootstrap libseccomp-dev \
	qemu-system-x86 cpio binutils \
	gcc-aarch64-linux-gnu binutils-aarch64-linux-gnu libc6-dev-arm64-cross qemu-system-arm qemu-user-static
# Minimal Debian trees (scripts/debootstrap_root.sh) for the tests that run things as containers:
# Debian 13's HAProxy 3.0 for the tests that run a scenario against both versions, Debian 12's 2.6
# as a pod's container, and the agent's image root (tests/src/haproxy.rs, tests/src/container.rs).
TRIXIE := $(CURDIR)/.tools/trixie
BOOKWORM_HAPROXY := $(CURDIR)/.tools/bookworm-haproxy
IMAGE_ROOT := $(CURDIR)/.tools/image
# The kernel matrix (tests/tests/kernels.rs): Debian 12's and Debian 13's kernels, booted under qemu
# with Debian 12's tree (HAProxy 2.6, h2load) as the guest's root, Debian 13's inside it.
VM_ROOT := $(CURDIR)/.tools/vm-bookworm
# The arm64 node of the kernel matrix: Debian 12's arm64 tree (HAProxy 2.6, h2load), debootstrapped
# through qemu-user-static (about 10 to 20 minutes, once), and Debian 12's arm64 kernel.
VM_ROOT_ARM64 := $(CURDIR)/.tools/vm-bookworm-arm64
# The aarch64 build (`make cross-arm64`): the agent for arm64 nodes, with its probes built for
# aarch64 by aya-build, cross-linked with Debian's gcc-aarch64-linux-gnu.
ARM64 := aarch64-unknown-linux-gnu
ARM64_ENV := CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
	CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
export DEBIAN_MIRROR ?= http://deb.debian.org/debian
BPF_LINKER_VERSION := 0.13.0
# Debian 12's kubectl (package kubernetes-client, kustomize 2.0.3), unpacked into the checkout:
# deploy/validate.sh renders every overlay with it. Not installed as a package, as it conflicts with
# the `kubectl` package some machines have.
KUBECTL_DEBIAN := $(CURDIR)/.tools/kubernetes-client/usr/bin/kubectl
# Manifest validation tools (PyPI), in a virtualenv of the checkout.
TOOLS := $(CURDIR)/.tools/venv
KUBERNETES_VALIDATE_VERSION := 1.37.0
CHECKOV_VERSION := 3.3.30

.PHONY: setup build test lint demo fuzz soak bench profile-probes clean cross-arm64 cross-arm64-agent

setup:
	@scripts/apt_install.sh $(APT_PACKAGES)
	@rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src' \
		|| rustup component add rust-src --toolchain nightly
	@rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^clippy' \
		|| rustup component add clippy --toolchain nightly
	@if ! bpf-linker --version 2>/dev/null | grep -q "$(BPF_LINKER_VERSION)"; then \
		echo "building bpf-linker $(BPF_LINKER_VERSION) against LLVM 22"; \
		LLVM_PREFIX=/usr/lib/llvm-22 LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 \
			cargo install bpf-linker --locked --version $(BPF_LINKER_VERSION) --no-default-features --features llvm-22; \
	fi
	@[ -x $(TRIXIE)/usr/sbin/haproxy ] || scripts/debootstrap_root.sh $(TRIXIE) trixie haproxy
	@scripts/debootstrap_root.sh $(BOOKWORM_HAPROXY) bookworm haproxy
	@scripts/debootstrap_root.sh $(IMAGE_ROOT) bookworm
	@scripts/debootstrap_root.sh $(VM_ROOT) bookworm haproxy,nghttp2-client,openssl,iproute2
	@scripts/vm_kernel.sh $(CURDIR)/.tools/kernel-bookworm bookworm
	@scripts/vm_kernel.sh $(CURDIR)/.tools/kernel-trixie trixie
	@rustup target list --installed | grep -qx $(ARM64) || rustup target add $(ARM64)
	@[ -e $(VM_ROOT_ARM64)/.complete ] || scripts/binfmt_aarch64.sh
	@scripts/debootstrap_root.sh $(VM_ROOT_ARM64) bookworm haproxy,nghttp2-client,openssl,iproute2 arm64
	@scripts/vm_kernel.sh $(CURDIR)/.tools/kernel-bookworm-arm64 bookworm arm64
	@if [ ! -x $(KUBECTL_DEBIAN) ]; then \
		echo "unpacking Debian's kubernetes-client into .tools/kubernetes-client"; \
		d=$$(mktemp -d) && chmod 755 $$d \
			&& (cd $$d && { apt-get download -q kubernetes-client || { apt-get update -q && apt-get download -q kubernetes-client; }; }) \
			&& rm -rf $(CURDIR)/.tools/kubernetes-client && dpkg-deb -x $$d/kubernetes-client_*.deb $(CURDIR)/.tools/kubernetes-client \
			&& rm -rf $$d || { echo "could not fetch kubernetes-client (apt-get update first?)"; exit 1; }; \
	fi
	@if ! $(TOOLS)/bin/pip freeze 2>/dev/null | grep -qx "checkov==$(CHECKOV_VERSION)" \
		|| ! $(TOOLS)/bin/pip freeze 2>/dev/null | grep -qx "kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)"; then \
		echo "installing kubernetes-validate $(KUBERNETES_VALIDATE_VERSION) and checkov $(CHECKOV_VERSION) into .tools/venv"; \
		python3 -m venv $(TOOLS) && $(TOOLS)/bin/pip install -q \
			kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION) checkov==$(CHECKOV_VERSION); \
	fi

build: setup
	cargo build

# The end-to-end tests run the agent binary, so it is built first, optimised as users run it
# (a debug agent falls behind HAProxy under the load tests when the suite runs in parallel).
test: setup cross-arm64
	cargo build --release -p tracetap
	TRACETAP_BIN=$(CURDIR)/target/release/tracetap cargo test -- --show-output
	TOOLS=$(TOOLS)/bin KUBECTL=$(KUBECTL_DEBIAN) deploy/validate.sh

lint: setup
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	# The probes are not a default member and build for BPF only: linted on that target (the
	# workspace lints, ebpf/probes/Cargo.toml), with the nightly toolchain that builds them.
	cd ebpf/probes && RUSTFLAGS='--cfg bpf_target_arch="x86_64"' cargo +nightly clippy --release --target bpfel-unknown-none \
		-Z build-std=core -p tracetap-ebpf -- -D warnings
	# ... and as built for arm64 nodes (`bpf_target_arch`, which aya-build sets from the agent's target).
	cd ebpf/probes && RUSTFLAGS='--cfg bpf_target_arch="aarch64"' cargo +nightly clippy --release --target bpfel-unknown-none \
		-Z build-std=core -p tracetap-ebpf -- -D warnings
	# A doc link that points nowhere (an item moved or renamed) fails, as a broken build would.
	RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -A rustdoc::private_intra_doc_links" cargo doc --no-deps --document-private-items \
		-p tracetap -p tracetap-proxy -p tracetap-storage -p tracetap-ebpf-common

# The agent for arm64 nodes, alone (deploy/Dockerfile's arm64 build runs this).
cross-arm64-agent:
	@rustup target list --installed | grep -qx $(ARM64) || rustup target add $(ARM64)
	$(ARM64_ENV) cargo build --release --locked -p tracetap --target $(ARM64)

# The agent and the kernel matrix's guest half for its arm64 guest (tests/tests/kernels.rs), in
# target/aarch64-unknown-linux-gnu/release. The guest half links libseccomp: the arm64 tree's own.
cross-arm64: setup
	mkdir -p target/arm64-libseccomp
	ln -sfn $(VM_ROOT_ARM64)/usr/lib/aarch64-linux-gnu/libseccomp.so.2 target/arm64-libseccomp/libseccomp.so
	$(ARM64_ENV) LIBSECCOMP_LIB_PATH=$(CURDIR)/target/arm64-libseccomp cargo build --release --locked \
		--target $(ARM64) -p tracetap -p tracetap-tests --bin tracetap --bin kernel-guest

demo: setup
	cargo build -p tracetap
	./scripts/demo.sh

# End-to-end overhead, one alternated run (BENCH_ROUNDS rounds, default 5; BENCH_SECONDS per
# measurement, default 8): no tracing, the agent's empty-program floor, the agent at ratio 1.0 and
# 0.0 and at its default sampler, and HAProxy's own OpenTracing filter (Datadog tracer) at rate-limit 100 and 0; saturated
# req/s (wrk) and CPU per request at 12 000 req/s (h2load). Prints a markdown table for
# docs/PERFORMANCE.md (scripts/bench_overhead.py says what is measured and why). Then the criterion
# micro-benchmarks of span encoding, the tail store (sled against an in-memory store), the agent's
# per-record path (against its budget in agent/benches/record_path_budget.txt) and the tail
# engine (CPU per span, RSS with 5 million spans buffered); last, the per-record path's
# instructions per request against their baselines (callgrind: steady on a busy machine).
# Only the benchmark needs these (h2load; the tracer plugin for HAProxy's filter; valgrind), so not in setup.
BENCH_PACKAGES := nghttp2-client libdd-opentracing0 valgrind
bench: setup
	@scripts/apt_install.sh $(BENCH_PACKAGES)
	cargo build --release -p tracetap -p tracetap-tests --bin tracetap --bin otlp-discard
	python3 scripts/bench_overhead.py
	cargo bench -p tracetap --bench encode
	cargo bench -p tracetap-storage --bench store
	cargo bench -p tracetap --bench tail
	cargo bench -p tracetap --bench record_path
	python3 scripts/record_path_instructions.py

# Where the probes' time goes inside HAProxy: clock samples of its CPU at the bench's fixed rate,
# per mode (PROFILE_MODES), summed into ns per request for the tracepoint dispatch, the programs,
# the head scan, user-memory copies, the ring and hash lookups (scripts/profile_probes.py).
profile-probes: setup
	@scripts/apt_install.sh $(BENCH_PACKAGES) linux-perf
	cargo build --release -p tracetap -p tracetap-tests --bin tracetap --bin otlp-discard
	python3 scripts/profile_probes.py

# 5 minutes of mixed traffic; prints the agent's RSS after the first minute and at the end.
SOAK_SECONDS ?= 300
soak: setup
	cargo build --release -p tracetap
	TRACETAP_BIN=$(CURDIR)/target/release/tracetap SOAK_SECONDS=$(SOAK_SECONDS) cargo test -p tracetap-tests --test soak -- --ignored --nocapture

# Runs every fuzz target for FUZZ_SECONDS (default 60) each, from the seeds in fuzz/seeds; new
# inputs collect in fuzz/corpus (not committed), crashes in fuzz/artifacts.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := tracker traceparent haproxy_config haproxy_runtime cgroup proxy_protocol head_drop h2
fuzz: setup
	@cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p fuzz/corpus/$$t; \
		echo "fuzzing $$t for $(FUZZ_SECONDS)s"; \
		cargo +nightly fuzz run $$t fuzz/corpus/$$t fuzz/seeds/$$t -- -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done

clean:
	cargo clean
