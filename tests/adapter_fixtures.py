"""What tests/test_adapter_pipecat.py and tests/test_adapter_livekit.py share: the gateways a scenarios
script (tests/adapter_scripts) runs against, the run itself, and the audio the synthetic backend makes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.adapter_env import prepare_all, run_in_adapter_env
from tests.gateway_server import RecordingBackend, running_gateway
from tts_backend.base import SynthesisRequest
from tts_backend.synthetic import SyntheticSynthesizer

SCRIPTS = Path(__file__).parent / "adapter_scripts"
VOICE = "tone-mid"


def synthetic_pcm(sentence: str, voice: str = VOICE) -> bytes:
    """The s16le audio the synthetic backend makes for one sentence at 24 kHz."""
    return SyntheticSynthesizer().render(SynthesisRequest(text=sentence, voice=voice)).tobytes()


def ws_base(server) -> str:
    return server.url.replace("http://", "ws://")


@contextmanager
def scenario_results(framework: str, plan: Callable[[str], dict]) -> Iterator[tuple[dict, RecordingBackend]]:
    """Run tests/adapter_scripts/<framework>_scenarios.py in the framework's venv with every scenario of
    `plan(forgetful_url)`, against a gateway with the synthetic backend (deterministic tones, named as such,
    paced at 4x real time and recorded per request). `forgetful_url` is a second gateway that forgets a
    session the moment its socket drops, so session.resume is refused there.

    Yields the observations by scenario name and the main gateway's recording backend."""
    prepare_all()  # both framework venvs at once, cached across runs
    backend = RecordingBackend(SyntheticSynthesizer(speed=4.0))
    # Strict voices, so that an unknown voice is a refusal the frameworks must not retry.
    with running_gateway(backend, voice_fallback=False) as server, running_gateway(
        RecordingBackend(SyntheticSynthesizer(speed=4.0)), session_ttl_s=0.0
    ) as forgetful:
        script = SCRIPTS / f"{framework}_scenarios.py"
        run = run_in_adapter_env(framework, script, ws_base(server), json.dumps(plan(ws_base(forgetful))))
        line = next(line for line in run.stdout.splitlines() if line.startswith("RESULTS "))
        yield json.loads(line[len("RESULTS "):]), backend


def scenario(results: tuple[dict, RecordingBackend], name: str) -> dict:
    """One scenario's observations; fails with the script's traceback when the scenario raised."""
    observed = results[0][name]
    assert "error" not in observed, observed["error"]
    return observed
