//! Compiles the .proto files with protox (pure Rust), so a fresh machine needs no `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/gpucp.proto",
        "proto/raft.proto",
        "proto/agent.proto",
        "proto/etcd_kv.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let descriptors = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
