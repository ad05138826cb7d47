//! The Kubernetes deployment (deploy/kubernetes) checked without a cluster.
//!
//! 1. `deploy/kubernetes/validate.py` validates every manifest against the Kubernetes API
//!    schemas with kubernetes-validate (strict), for the oldest Kubernetes the base supports
//!    and the newest the validator knows, and checks what schemas cannot (names, selectors,
//!    ports, volumes, the kustomization's list). The validator is installed, pinned by
//!    `deploy/kubernetes/requirements.txt`, into a virtual environment under the target
//!    directory on first use (PyPI must be reachable then).
//! 2. Then, for each pod the StatefulSet and the DaemonSet would run, the flags as the kubelet
//!    would expand them (`$(VAR)` from the downward API) go through the binaries' own flag
//!    parsers and configuration checks, with the mounted paths pointing at the config file
//!    and the certificates `deploy/kubernetes/make-certs.sh` issues: each replica resolves to
//!    its own id, advertises the address its peers know it by and loads a replica certificate
//!    named for that id; each agent loads the node certificate of its node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use control_plane::config::{ReplicaArgs, TransportSecurity};
use node_agent::agent::cli::AgentArgs;
use proto::tls::{CertRole, ClientAuth, TlsContext, TlsPaths};
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn k8s_dir() -> PathBuf {
    repo().join("deploy/kubernetes")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The Python of a virtual environment with requirements.txt installed: made once under the
/// target directory (beside the binaries under test) and remade when the pins change.
fn validator_python() -> PathBuf {
    let target = Path::new(env!("CARGO_BIN_EXE_gpuctl"))
        .parent()
        .and_then(Path::parent)
        .expect("the target directory")
        .to_owned();
    let requirements = k8s_dir().join("requirements.txt");
    let pins = std::fs::read_to_string(&requirements).expect("requirements.txt");
    let venv = target.join("k8s-venv");
    let stamp = venv.join("requirements.txt");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(pins.as_str()) {
        return venv.join("bin/python");
    }
    // Built beside and renamed into place, so that a run that is interrupted, or one running
    // concurrently, never sees half an environment.
    let building = target.join(format!("k8s-venv.building-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&building);
    run(Command::new("python3").arg("-m").arg("venv").arg(&building));
    run(Command::new(building.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg("-r")
        .arg(&requirements));
    std::fs::write(building.join("requirements.txt"), &pins).unwrap();
    let _ = std::fs::remove_dir_all(&venv);
    if std::fs::rename(&building, &venv).is_err() {
        // Another run put its environment there first; use that one.
        let _ = std::fs::remove_dir_all(&building);
    }
    venv.join("bin/python")
}

/// `--flag` names a binary's `--help` lists.
fn help_flags(cmd: &mut Command) -> Vec<String> {
    let help = run(cmd.arg("--help"));
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_owned())
        .collect()
}

fn flag_name(arg: &str) -> Option<&str> {
    arg.starts_with("--")
        .then(|| arg.split('=').next().unwrap())
}

/// The kubelet's expansion of `$(VAR)` in command and args (`$$` is a literal `$`; an
/// undefined variable stays as written, as the kubelet leaves it).
fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        if let Some(after) = rest.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(end) = rest.strip_prefix("$(").and_then(|r| r.find(')')) {
            let name = &rest[2..2 + end];
            match env.get(name) {
                Some(v) => out.push_str(v),
                None => out.push_str(&rest[..3 + end]),
            }
            rest = &rest[3 + end..];
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The container's environment for one pod: fields of the downward API from `fields`.
fn pod_env(container: &Value, fields: &BTreeMap<&str, String>) -> BTreeMap<String, String> {
    container["env"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, source)| {
            let value = match (source["value"].as_str(), source["fieldPath"].as_str()) {
                (Some(v), _) => v.to_owned(),
                (None, Some(path)) => fields
                    .get(path)
                    .unwrap_or_else(|| panic!("env {name}: no test value for field {path}"))
                    .clone(),
                _ => panic!("env {name}: neither a value nor a field"),
            };
            (name.clone(), value)
        })
        .collect()
}

/// Maps paths inside the container to files here, by mount.
struct Mounts(Vec<(String, Value)>);

impl Mounts {
    fn of(container: &Value) -> Mounts {
        Mounts(
            container["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| (m["mountPath"].as_str().unwrap().to_owned(), m.clone()))
                .collect(),
        )
    }

    /// The mount that holds `path`, and the path relative to it.
    fn find(&self, path: &Path) -> Option<(&Value, PathBuf)> {
        self.0
            .iter()
            .find_map(|(mount, m)| path.strip_prefix(mount).ok().map(|rel| (m, rel.to_owned())))
    }

    /// Rewrites each `--flag=/path` under a mount to the local directory `local(mount)` gives.
    fn localize(&self, args: &[String], local: &dyn Fn(&Value) -> PathBuf) -> Vec<String> {
        args.iter()
            .map(|arg| match arg.split_once('=') {
                Some((flag, value)) if value.starts_with('/') => {
                    match self.find(Path::new(value)) {
                        Some((m, rel)) => format!("{flag}={}", local(m).join(rel).display()),
                        None => arg.clone(),
                    }
                }
                _ => arg.clone(),
            })
            .collect()
    }
}

#[derive(Parser)]
struct ReplicaCli {
    #[command(flatten)]
    args: ReplicaArgs,
}

#[derive(Parser)]
struct AgentCli {
    #[command(flatten)]
    args: AgentArgs,
}

fn grpc_probe(container: &Value, probe: &str) -> (u64, String) {
    let grpc = &container["probes"][probe]["grpc"];
    assert!(grpc.is_object(), "{probe} is not a grpc probe: {container}");
    (
        grpc["port"].as_u64().expect("a numeric probe port"),
        grpc["service"].as_str().unwrap_or("").to_owned(),
    )
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{addr:?} is not HOST:PORT"))
}

#[test]
fn the_kubernetes_manifests_validate_and_their_flags_and_files_work_with_the_binaries() {
    let scratch = tempfile::tempdir().unwrap();

    // 1. Schemas and cross-references.
    let dump = scratch.path().join("manifests.json");
    let report = run(Command::new(validator_python())
        .arg(k8s_dir().join("validate.py"))
        .arg("--dump")
        .arg(&dump));
    eprint!("{report}");
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&dump).unwrap()).unwrap();

    // The certificates, issued as the README says.
    let pki = scratch.path().join("pki");
    let nodes = ["gpu-node-a", "dgx-07.example.internal"];
    run(Command::new("bash")
        .arg(k8s_dir().join("make-certs.sh"))
        .args(["--gpuctl", env!("CARGO_BIN_EXE_gpuctl"), "--out"])
        .arg(&pki)
        .args(nodes));
    // make-certs.sh lays out each Secret's files exactly as secrets.example.yaml names them.
    for (secret, keys) in m["secrets"].as_object().unwrap() {
        let mut files: Vec<String> = std::fs::read_dir(pki.join(secret))
            .unwrap_or_else(|e| panic!("make-certs.sh made no {secret}/: {e}"))
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        let keys: Vec<String> = serde_json::from_value(keys.clone()).unwrap();
        assert_eq!(
            files, keys,
            "Secret {secret}: files from make-certs.sh vs keys"
        );
    }

    // Config files as the ConfigMap volumes would show them.
    let configmaps = scratch.path().join("configmaps");
    for (name, data) in m["configmaps"].as_object().unwrap() {
        std::fs::create_dir_all(configmaps.join(name)).unwrap();
        for (key, text) in data.as_object().unwrap() {
            std::fs::write(configmaps.join(name).join(key), text.as_str().unwrap()).unwrap();
        }
    }
    let local = |mount: &Value| -> PathBuf {
        let name = mount["name"].as_str().unwrap_or_default();
        match mount["kind"].as_str().unwrap() {
            "configMap" => configmaps.join(name),
            "secret" => pki.join(name),
            other => scratch.path().join(other),
        }
    };

    // 2a. The replicas.
    let sts = &m["statefulset"];
    let replica = &sts["containers"][0];
    assert!(
        replica["command"].as_array().unwrap().is_empty(),
        "the replica image's entrypoint is control-plane; the manifest gives args only"
    );
    let cp_flags = help_flags(&mut Command::new(env!("CARGO_BIN_EXE_control-plane")));
    let (health_port, readiness) = grpc_probe(replica, "readinessProbe");
    assert_eq!(readiness, control_plane::health::READINESS);
    for probe in ["livenessProbe", "startupProbe"] {
        assert_eq!(
            grpc_probe(replica, probe),
            (health_port, control_plane::health::LIVENESS.to_owned()),
            "{probe}"
        );
    }
    assert_eq!(replica["ports"]["health"].as_u64(), Some(health_port));
    let mounts = Mounts::of(replica);
    let (start, count) = (
        sts["ordinalStart"].as_u64().unwrap(),
        sts["replicas"].as_u64().unwrap(),
    );
    let grpc_port = replica["ports"]["grpc"].as_u64().unwrap();
    let mut pods = Vec::new();
    for ordinal in start..start + count {
        let pod = format!("{}-{ordinal}", sts["name"].as_str().unwrap());
        pods.push(format!(
            "{pod}.{}:{grpc_port}",
            sts["serviceName"].as_str().unwrap()
        ));
        let fields = BTreeMap::from([
            ("metadata.name", pod.clone()),
            (
                "metadata.namespace",
                m["namespace"].as_str().unwrap().into(),
            ),
            (
                "metadata.labels['apps.kubernetes.io/pod-index']",
                ordinal.to_string(),
            ),
        ]);
        let env = pod_env(replica, &fields);
        let args: Vec<String> = replica["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| expand(a.as_str().unwrap(), &env))
            .collect();
        for arg in &args {
            let flag = flag_name(arg).unwrap_or_else(|| panic!("{pod}: {arg:?} is not a flag"));
            assert!(
                cp_flags.iter().any(|f| f == flag),
                "{pod}: control-plane has no flag {flag}"
            );
        }
        if let Some(health) = args.iter().find_map(|a| a.strip_prefix("--health-listen=")) {
            assert_eq!(
                port_of(health),
                health_port,
                "the probes ask the health port"
            );
        }
        let args = mounts.localize(&args, &local);
        let cli =
            ReplicaCli::try_parse_from(std::iter::once("control-plane".to_owned()).chain(args))
                .unwrap_or_else(|e| panic!("{pod}: control-plane refuses its flags: {e}"));
        let config = cli
            .args
            .resolve()
            .unwrap_or_else(|e| panic!("{pod}: the configuration does not resolve: {e:#}"));
        assert_eq!(config.id, ordinal, "{pod}: the replica id is the ordinal");
        assert_eq!(config.peers.len() as u64, count, "{pod}: peers");
        assert_eq!(port_of(&config.listen), grpc_port, "{pod}: listen port");
        match mounts.find(&config.data_dir) {
            Some((mount, rel)) => assert!(
                mount["kind"] == "persistentVolumeClaim" && rel.components().next().is_some(),
                "{pod}: data_dir {} must be a directory inside the volume",
                config.data_dir.display()
            ),
            None => panic!(
                "{pod}: data_dir {} is on no volume",
                config.data_dir.display()
            ),
        }
        let TransportSecurity::Tls { files, .. } = config.security else {
            panic!("{pod}: the replica must run with TLS");
        };
        let tls = TlsContext::load(files, ClientAuth::Required)
            .unwrap_or_else(|e| panic!("{pod}: its certificate files do not load: {e}"));
        let id = tls.identity().expect("a replica has a certificate");
        assert_eq!(id.role, CertRole::Replica, "{pod}");
        assert_eq!(
            id.name,
            format!("replica-{ordinal}"),
            "{pod}: the certificate's name"
        );
    }
    // The replicas know each other by the names the headless Service gives the pods.
    let toml_peers: Vec<String> = {
        let text = std::fs::read_to_string(configmaps.join("gpucp-config/replica.toml")).unwrap();
        let file: toml::Value = toml::from_str(&text).unwrap();
        file["peers"]
            .as_str()
            .unwrap()
            .split(',')
            .map(|p| p.split_once('=').unwrap().1.to_owned())
            .collect()
    };
    assert_eq!(toml_peers, pods);

    // 2b. The agents: the image's entrypoint is node-agent, whose flags are `gpuctl agent`'s.
    let agent = &m["daemonset"]["containers"][0];
    assert!(agent["command"].as_array().unwrap().is_empty());
    let agent_flags = help_flags(Command::new(env!("CARGO_BIN_EXE_gpuctl")).arg("agent"));
    let mounts = Mounts::of(agent);
    let agent_port = agent["ports"]["agent"].as_u64().unwrap();
    for node in nodes {
        let fields = BTreeMap::from([
            ("spec.nodeName", node.to_owned()),
            ("status.hostIP", "10.20.30.40".to_owned()),
        ]);
        let env = pod_env(agent, &fields);
        let args: Vec<String> = agent["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| expand(a.as_str().unwrap(), &env))
            .collect();
        for arg in &args {
            let flag = flag_name(arg).unwrap_or_else(|| panic!("{node}: {arg:?} is not a flag"));
            assert!(
                agent_flags.iter().any(|f| f == flag),
                "{node}: node-agent has no flag {flag}"
            );
        }
        // The node certificates live on each host (a hostPath): make-certs.sh's nodes/<node>.
        let local = |mount: &Value| -> PathBuf {
            if mount["kind"] == "hostPath" && mount["readOnly"] == true {
                pki.join("nodes").join(node)
            } else {
                scratch.path().join("host")
            }
        };
        let args = mounts.localize(&args, &local);
        let cli = AgentCli::try_parse_from(std::iter::once("node-agent".to_owned()).chain(args))
            .unwrap_or_else(|e| panic!("{node}: node-agent refuses its flags: {e}"));
        let a = cli.args;
        assert_eq!(a.name.as_deref(), Some(node));
        assert_eq!(a.control_plane.split(',').collect::<Vec<_>>(), pods);
        assert_eq!(port_of(&a.listen), agent_port);
        assert_eq!(a.advertise.as_deref(), Some("10.20.30.40:7100"));
        assert!(!a.insecure);
        let files = TlsPaths {
            dir: a.tls_dir.clone(),
            ca: a.tls_ca.clone(),
            cert: a.tls_cert.clone(),
            key: a.tls_key.clone(),
        }
        .files()
        .unwrap()
        .expect("the agent is given TLS files");
        let tls = TlsContext::load(files, ClientAuth::Required)
            .unwrap_or_else(|e| panic!("{node}: its certificate files do not load: {e}"));
        let id = tls.identity().expect("an agent has a certificate");
        assert_eq!((id.role, id.name.as_str()), (CertRole::Node, node));
        // The state directory is on the host, so a new agent pod finds the old one's records.
        let state = Path::new(
            agent["args"]
                .as_array()
                .unwrap()
                .iter()
                .find_map(|a| a.as_str().unwrap().strip_prefix("--state-dir="))
                .expect("--state-dir"),
        );
        let (mount, _) = mounts.find(state).expect("the state dir is mounted");
        assert_eq!(
            mount["kind"], "hostPath",
            "the state dir must survive the pod"
        );
    }
}
