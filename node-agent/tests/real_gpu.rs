//! Checks that need a real NVIDIA GPU, run only where `GPUCP_REAL_GPU=1` (no CI machine has
//! one; `deploy/gpu-check.sh` runs them on a lent GPU machine and keeps what they printed):
//! NVML discovery agrees with the driver's device nodes, per-process sampling answers, and an
//! allocation's cgroup lets a process open its own GPU's `/dev/nvidiaN` and not another's.

use std::path::Path;
use std::process::Command;

use node_agent::cgroup::Cgroups;
use node_agent::cgroup::devices::{DriverMajors, allocation_rules};
use node_agent::gpu::GpuBackend;
use node_agent::gpu::nvml::NvmlBackend;

fn enabled() -> bool {
    let on = std::env::var("GPUCP_REAL_GPU").is_ok_and(|v| v == "1");
    if !on {
        eprintln!("GPUCP_REAL_GPU is not 1: real-GPU checks not run");
    }
    on
}

#[test]
fn nvml_discovers_every_gpu_with_its_device_node_and_links() {
    if !enabled() {
        return;
    }
    let backend = NvmlBackend::new().expect("NVML loads on a GPU host");
    let inv = backend.inventory().expect("an inventory");
    println!("driver {}; {} GPU(s)", inv.driver, inv.gpus.len());
    assert!(!inv.gpus.is_empty());
    for g in &inv.gpus {
        println!(
            "GPU {} {} {} {} MiB NUMA {:?} MIG slices {}",
            g.index,
            g.uuid,
            g.model,
            g.memory_mib,
            g.numa_node,
            g.mig_instances.len()
        );
        assert!(g.uuid.starts_with("GPU-"), "{g:?}");
        assert!(
            Path::new(&format!("/dev/nvidia{}", g.index)).exists(),
            "{g:?}"
        );
    }
    assert_eq!(
        inv.topology.links.len(),
        inv.gpus.len(),
        "a square link matrix"
    );
    println!("links: {:?}", inv.topology.links);
    let samples = backend.process_samples();
    println!("per-process samples now: {samples:?}");
}

#[test]
fn an_allocations_cgroup_opens_its_own_gpu_and_refuses_the_others() {
    if !enabled() {
        return;
    }
    let inv = NvmlBackend::new().unwrap().inventory().unwrap();
    let majors = DriverMajors::parse(&std::fs::read_to_string("/proc/devices").unwrap());
    let host = Cgroups::detect(Path::new("gpucp-real-gpu-check")).expect("a writable hierarchy");
    // With one GPU the allocation holds none of it and must be refused; with more, it holds
    // GPU 0 and must be refused GPU 1.
    let (mine, other): (Vec<u32>, u32) = if inv.gpus.len() == 1 {
        (Vec::new(), 0)
    } else {
        (vec![0], 1)
    };
    let limits = node_agent::cgroup::Limits {
        devices: Some(allocation_rules(&mine, &[], majors)),
        ..Default::default()
    };
    let (cg, enforced) = host.create("alloc-check", &limits).unwrap();
    println!("enforced: {}", enforced.describe());
    let join = cg
        .procs_files()
        .iter()
        .map(|f| format!("echo $$ > {};", f.display()))
        .collect::<String>();
    let open = |n: u32| {
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("{join} exec 3</dev/nvidia{n} && echo opened"))
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    if let Some(m) = mine.first() {
        let own = open(*m);
        println!("own GPU {m}: {own}");
        assert!(own.contains("opened"), "{own}");
    }
    let theirs = open(other);
    println!("other GPU {other}: {theirs}");
    assert!(theirs.contains("Operation not permitted"), "{theirs}");
    let smi = Command::new("sh")
        .arg("-c")
        .arg(format!("{join} exec nvidia-smi -L"))
        .output();
    println!("nvidia-smi -L inside the cgroup: {smi:?}");
    cg.kill_all().unwrap();
    cg.remove().unwrap();
    host.remove_parent().unwrap();
}
