//! Builds the eBPF probes (`ebpf/probes`) for the BPF target with the nightly toolchain and
//! bpf-linker, and places the object in `OUT_DIR`, where `capture::loader` embeds it.
fn main() -> aya_build::Result<()> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../ebpf/probes");
    // The probes also compile ebpf/common; aya-build only watches the probes' own directory.
    println!("cargo:rerun-if-changed={}", concat!(env!("CARGO_MANIFEST_DIR"), "/../ebpf/common"));
    aya_build::build_ebpf(
        [aya_build::Package { name: "tracetap-ebpf", root_dir: root, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
}
