#!/usr/bin/env python3
"""Checks the Kustomize base in this directory, without a cluster.

1. Every manifest against the Kubernetes API schemas (kubernetes-validate, strict: unknown
   fields are errors) for each version in --kubernetes-version (default: the oldest version
   the base supports and the newest the validator knows).
2. What a schema cannot see: kustomization.yaml lists exactly the manifests here; names,
   namespaces, selectors and labels agree; the StatefulSet's serviceName is a headless Service
   that publishes not-ready addresses; the PodDisruptionBudget selects the replicas and only
   them; probes and Service targetPorts name container ports; mounts name volumes; ConfigMap
   and Secret volumes name objects (and keys) that exist; every $(VAR) in args is an env var
   of that container; the peers in the replicas' config are the StatefulSet's pods.
3. With --dump FILE, writes what control-plane/tests/kubernetes_manifests.rs needs to check
   the flags and files against the binaries themselves (JSON).

Usage: validate.py [--kubernetes-version V]... [--dump FILE]
Needs PyYAML and kubernetes-validate (requirements.txt). Exit status 1 on any problem.
"""

import argparse
import json
import os
import re
import sys

import kubernetes_validate
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
# StatefulSet ordinals (`spec.ordinals`) are on by default from 1.27 and the pod-index label
# from 1.28; 1.30 is the oldest schema set kubernetes-validate still ships.
OLDEST_SUPPORTED = "1.30"
# Not listed in kustomization.yaml on purpose.
NOT_IN_KUSTOMIZATION = {"secrets.example.yaml"}

problems = []


def problem(msg):
    problems.append(msg)


def load_all(name):
    with open(os.path.join(HERE, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def selects(selector, labels):
    """Whether a matchLabels-style selector (dict) selects `labels`."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(container):
    by_name, numbers = {}, set()
    for p in container.get("ports", []):
        numbers.add(p["containerPort"])
        if "name" in p:
            by_name[p["name"]] = p["containerPort"]
    return by_name, numbers


def port_ok(port, container):
    by_name, numbers = container_ports(container)
    return port in by_name if isinstance(port, str) else port in numbers


def check_pod(kind_name, pod, secrets, configmaps):
    """Checks one pod template; returns its containers as the dump describes them."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    summary = []
    for c in pod.get("containers", []):
        where = f"{kind_name} container {c['name']}"
        env = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = {"value": e["value"]}
            else:
                env[e["name"]] = {"fieldPath": e["valueFrom"]["fieldRef"]["fieldPath"]}
        for arg in c.get("command", []) + c.get("args", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                if var not in env:
                    problem(f"{where}: argument {arg!r} uses $({var}), which is not in its env")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = c.get(probe)
            if p is None:
                if probe != "startupProbe":
                    problem(f"{where}: no {probe}")
                continue
            for handler in ("grpc", "tcpSocket", "httpGet"):
                if handler in p and not port_ok(p[handler]["port"], c):
                    problem(f"{where}: {probe} port {p[handler]['port']!r} is not a container port")
        mounts = []
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"])
            if v is None:
                if m["name"] not in kind_name_claims.get(kind_name, ()):
                    problem(f"{where}: mount {m['name']!r} names no volume")
                mounts.append({"mountPath": m["mountPath"], "kind": "persistentVolumeClaim"})
                continue
            entry = {"mountPath": m["mountPath"], "readOnly": m.get("readOnly", False)}
            if "secret" in v:
                name = v["secret"]["secretName"]
                entry.update(kind="secret", name=name)
                if name not in secrets:
                    problem(f"{where}: Secret {name!r} is not in secrets.example.yaml")
                if "subPath" in m:
                    problem(f"{where}: a subPath mount of Secret {name!r} would never see a renewed certificate")
            elif "configMap" in v:
                name = v["configMap"]["name"]
                entry.update(kind="configMap", name=name)
                if name not in configmaps:
                    problem(f"{where}: ConfigMap {name!r} is not in the kustomization")
            elif "hostPath" in v:
                entry.update(kind="hostPath", path=v["hostPath"]["path"])
            elif "emptyDir" in v:
                entry.update(kind="emptyDir")
            else:
                problem(f"{where}: volume {m['name']!r} is of a kind this check does not know")
            mounts.append(entry)
        summary.append(
            {
                "name": c["name"],
                "image": c["image"],
                "command": c.get("command", []),
                "args": c.get("args", []),
                "env": env,
                "mounts": mounts,
                "ports": {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p},
                "probes": {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in c},
            }
        )
    return summary


# Volume claim templates of each workload ("StatefulSet/gpucp" -> {"data"}).
kind_name_claims = {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kubernetes-version", action="append", dest="versions")
    ap.add_argument("--dump", metavar="FILE")
    opts = ap.parse_args()
    versions = opts.versions or [
        OLDEST_SUPPORTED,
        kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version()),
    ]

    kustomization = load_all("kustomization.yaml")[0]
    listed = kustomization.get("resources", [])
    present = sorted(
        f
        for f in os.listdir(HERE)
        if f.endswith((".yaml", ".yml")) and f != "kustomization.yaml"
    )
    for f in listed:
        if not os.path.exists(os.path.join(HERE, f)):
            problem(f"kustomization.yaml lists {f}, which does not exist")
    for f in present:
        if f not in listed and f not in NOT_IN_KUSTOMIZATION:
            problem(f"{f} is not listed in kustomization.yaml")
    namespace = kustomization.get("namespace")

    resources = []  # (file, doc)
    for f in listed:
        if os.path.exists(os.path.join(HERE, f)):
            resources += [(f, d) for d in load_all(f)]
    examples = [(f, d) for f in sorted(NOT_IN_KUSTOMIZATION) for d in load_all(f)]

    # 1. The schemas.
    checked = 0
    for version in versions:
        for f, doc in resources + examples:
            what = f"{f}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                problem(f"{what} is not valid for Kubernetes {version} at {path or '/'}: {e.message}")
            except Exception as e:  # no schema for the kind, unsupported version
                problem(f"{what} cannot be validated for Kubernetes {version}: {getattr(e, 'message', e)}")

    # 2. Our own checks.
    by_kind = {}
    for f, doc in resources:
        by_kind.setdefault(doc["kind"], []).append(doc)
        meta = doc["metadata"]
        if doc["kind"] != "Namespace" and meta.get("namespace") != namespace:
            problem(f"{f}: {doc['kind']}/{meta['name']} is in namespace {meta.get('namespace')!r}, not {namespace!r}")
        if doc["kind"] == "Namespace" and meta["name"] != namespace:
            problem(f"{f}: the Namespace is {meta['name']!r}, the kustomization's {namespace!r}")
    secrets = {d["metadata"]["name"]: sorted(d.get("stringData", {}) | d.get("data", {})) for _, d in examples if d["kind"] == "Secret"}
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in by_kind.get("ConfigMap", [])}
    missing = False
    for kind, count in (("StatefulSet", 1), ("DaemonSet", 1), ("PodDisruptionBudget", 1)):
        if len(by_kind.get(kind, [])) != count:
            problem(f"the kustomization has {len(by_kind.get(kind, []))} {kind}s, not {count}")
            missing = True
    for kind in ("Service", "ConfigMap", "Namespace"):
        if kind not in by_kind:
            problem(f"no {kind} in the kustomization")
            missing = True
    if missing:
        return finish(checked, versions, opts, None)

    (sts,) = by_kind["StatefulSet"]
    (ds,) = by_kind["DaemonSet"]
    (pdb,) = by_kind["PodDisruptionBudget"]
    sts_name = sts["metadata"]["name"]
    kind_name_claims[f"StatefulSet/{sts_name}"] = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    sts_labels = sts["spec"]["template"]["metadata"]["labels"]
    ds_labels = ds["spec"]["template"]["metadata"]["labels"]
    for w, labels in ((sts, sts_labels), (ds, ds_labels)):
        if not selects(w["spec"]["selector"]["matchLabels"], labels):
            problem(f"{w['kind']}/{w['metadata']['name']}: its selector does not select its own pods")
    if selects(sts["spec"]["selector"]["matchLabels"], ds_labels) or selects(ds["spec"]["selector"]["matchLabels"], sts_labels):
        problem("the StatefulSet's and the DaemonSet's selectors overlap")

    spec = sts["spec"]
    if spec.get("replicas") != 3:
        problem(f"StatefulSet/{sts_name}: {spec.get('replicas')} replicas, not 3")
    start = spec.get("ordinals", {}).get("start", 0)
    if start != 1:
        problem(f"StatefulSet/{sts_name}: ordinals start at {start}: replica ids are the ordinals and start at 1")
    if spec.get("podManagementPolicy") != "Parallel":
        problem(f"StatefulSet/{sts_name}: OrderedReady would wait for replica 1 to be ready, which needs a quorum of started replicas")
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    peers_svc = services.get(spec["serviceName"])
    if peers_svc is None:
        problem(f"StatefulSet/{sts_name}: serviceName {spec['serviceName']!r} is no Service")
    else:
        if peers_svc["spec"].get("clusterIP") != "None":
            problem(f"Service/{spec['serviceName']}: the StatefulSet's service must be headless (clusterIP: None)")
        if not peers_svc["spec"].get("publishNotReadyAddresses"):
            problem(f"Service/{spec['serviceName']}: needs publishNotReadyAddresses, or peers cannot find each other before a leader exists")
    (replica,) = spec["template"]["spec"]["containers"]
    for s in services.values():
        if not selects(s["spec"].get("selector"), sts_labels):
            problem(f"Service/{s['metadata']['name']} does not select the replica pods")
        for p in s["spec"]["ports"]:
            if not port_ok(p.get("targetPort", p["port"]), replica):
                problem(f"Service/{s['metadata']['name']}: targetPort {p.get('targetPort')!r} is not a replica container port")

    if pdb["spec"].get("maxUnavailable") != 1:
        problem("the PodDisruptionBudget must allow exactly one replica down (maxUnavailable: 1)")
    if not selects(pdb["spec"]["selector"]["matchLabels"], sts_labels):
        problem("the PodDisruptionBudget does not select the replica pods")
    if selects(pdb["spec"]["selector"]["matchLabels"], ds_labels):
        problem("the PodDisruptionBudget also selects the agents")

    strategy = ds["spec"].get("updateStrategy", {})
    if strategy.get("type") != "RollingUpdate" or "maxUnavailable" not in strategy.get("rollingUpdate", {}):
        problem("the DaemonSet must roll out with RollingUpdate and a maxUnavailable")
    ds_pod = ds["spec"]["template"]["spec"]
    if not ds_pod.get("nodeSelector"):
        problem("the DaemonSet has no nodeSelector: agents belong on GPU nodes only")

    sts_pod = spec["template"]["spec"]
    replicas = check_pod(f"StatefulSet/{sts_name}", sts_pod, secrets, configmaps)
    agents = check_pod(f"DaemonSet/{ds['metadata']['name']}", ds_pod, secrets, configmaps)
    if agents and agents[0]["env"].get("NODE_NAME") != {"fieldPath": "spec.nodeName"}:
        problem("the agent's NODE_NAME must come from spec.nodeName")

    # The peers the config file names are the StatefulSet's pods under its service.
    port = next(p["containerPort"] for p in replica["ports"] if p.get("name") == "grpc")
    expected = ",".join(f"{i}={sts_name}-{i}.{spec['serviceName']}:{port}" for i in range(start, start + spec["replicas"]))
    for name, data in configmaps.items():
        for key, text in data.items():
            m = re.search(r'^peers\s*=\s*"([^"]*)"', text, re.M)
            if key.endswith(".toml") and m and m.group(1) != expected:
                problem(f"ConfigMap/{name} {key}: peers = {m.group(1)!r}, but the pods are {expected!r}")

    dump = {
        "namespace": namespace,
        "statefulset": {
            "name": sts_name,
            "serviceName": spec["serviceName"],
            "replicas": spec["replicas"],
            "ordinalStart": start,
            "containers": replicas,
        },
        "daemonset": {"name": ds["metadata"]["name"], "containers": agents},
        "configmaps": configmaps,
        "secrets": secrets,
    }
    return finish(checked, versions, opts, dump)


def finish(checked, versions, opts, dump):
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if opts.dump and dump is not None:
        with open(opts.dump, "w") as f:
            json.dump(dump, f, indent=2)
    print(
        f"kubernetes-validate {kubernetes_validate.__version__}: {checked} manifest checks "
        f"(Kubernetes {', '.join(versions)}, strict), {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
