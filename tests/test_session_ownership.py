"""Session ownership (issue 12, item 1): a session belongs to the API key that created it. Another key, or
a token minted by another key, that sends `session.resume` is told `session_not_found` exactly as for a
session that never existed, and changes nothing: the owner keeps its lease and its audio, nothing of the
intruder's is spoken. A resume refused for its position (`resume_out_of_range`) changes nothing either."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets

from tests.gateway_server import running_gateway
from tests.redis_fixtures import REDIS_URL, redis_cluster, redis_prefix, redis_target  # noqa: F401 (fixture)
from tests.resume_fixtures import PACED, Listener, gateways, receive_into_sentence, start_session, uninterrupted_pcm
from tests.test_resume_replicas import TEXT

KEY_A = "k-tenant-a-0123456789"
KEY_B = "k-tenant-b-9876543210"
KEYS = ("--api-key", KEY_A, "--api-key", KEY_B)


def mint(base_url: str, key: str) -> str:
    response = httpx.post(base_url + "/v1/tokens", headers={"Authorization": f"Bearer {key}"})
    response.raise_for_status()
    return response.json()["token"]


async def refused_resume(ws_url: str, credential: str, resume: dict) -> dict:
    """Send `resume` with `credential` and return the answer, which must be an error that leaves the
    socket open (then checked by a session.config that never gets spoken into)."""
    async with websockets.connect(f"{ws_url}?api_key={credential}", max_size=None) as ws:
        await ws.send(json.dumps(resume))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
        # The intruder's text, had the resume been accepted, would have been spoken in the owner's session.
        await ws.send(json.dumps({"type": "input.text", "text": "Spoken by the intruder."}))
        after = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert after["type"] == "error" and after["code"] == "config_required", after
        return answer


async def test_another_key_cannot_resume_a_session_on_another_replica(redis_target, redis_prefix):  # noqa: F811
    with gateways(redis_target.url, redis_prefix, 2, *PACED, *KEYS, *redis_target.flags) as (a, b):
        reference = await uninterrupted_pcm(f"{b.ws_url}?api_key={KEY_A}", TEXT)
        owner = Listener()
        ws = await websockets.connect(f"{a.ws_url}?api_key={KEY_A}", max_size=None)
        await start_session(ws, owner, TEXT)
        await receive_into_sentence(ws, owner, 1)  # the owner is mid-sentence, live on replica a

        resume = json.loads(owner.resume_message())
        unknown = await refused_resume(b.ws_url, KEY_B, {**resume, "session_id": "no-such-session"})
        by_key = await refused_resume(b.ws_url, KEY_B, resume)
        by_token = await refused_resume(b.ws_url, mint(b.url, KEY_B), resume)
        # Exactly as if the session did not exist: same code, same wording (but for the id it names).
        for answer in (by_key, by_token):
            assert answer["type"] == "error" and answer["code"] == "session_not_found", answer
            assert answer["message"] == unknown["message"].replace("no-such-session", resume["session_id"])
            assert answer["retryable"] is False

        # The owner was never interrupted: all its audio, no error, nothing of the intruder's.
        done = await owner.receive(ws, "session.done")
        await ws.close()
        assert done["total_sentences"] == 4
        assert owner.pcm() == reference
        assert not [m for m in owner.messages if m["type"] == "error"]
        texts = [m["sentence_text"] for m in owner.messages if m["type"] == "audio.start"]
        assert not any("intruder" in text for text in texts) and len(texts) == 4

        # The owner's own key (here through a token it minted) still resumes it: only the key decides.
        async with websockets.connect(f"{b.ws_url}?api_key={mint(b.url, KEY_A)}", max_size=None) as ws:
            await ws.send(owner.resume_message())
            started = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert started["type"] == "session.started" and started["session_id"] == owner.session_id


async def test_a_refused_resume_position_does_not_evict_the_live_owner():
    """Memory store: a resume at a position never sent is refused before the lease is taken, so the owner's
    next write still finds the session its own."""
    with running_gateway(backend="synthetic", session_lease_s=0.3) as server:
        owner = Listener()
        ws = await websockets.connect(server.ws_url, max_size=None)
        await start_session(ws, owner, "Spoken before the refused resume.", done=False)
        await ws.send(json.dumps({"type": "input.flush"}))
        await owner.receive(ws, "audio.done")

        for index, received in [(5, 0), (0, 10**9)]:
            async with websockets.connect(server.ws_url, max_size=None) as intruder:
                await intruder.send(json.dumps({"type": "session.resume", "session_id": owner.session_id,
                                                "sentence_index": index, "bytes_received": received}))
                error = json.loads(await asyncio.wait_for(intruder.recv(), 10))
                assert error["code"] == "resume_out_of_range", error

        # The owner still holds the session (its writes are fenced by the lease) and speaks on.
        await ws.send(json.dumps({"type": "input.text", "text": " And after it."}))
        await ws.send(json.dumps({"type": "input.done"}))
        done = await owner.receive(ws, ("session.done", "error"))
        await ws.close()
        assert done == {"type": "session.done", "total_sentences": 2}
        assert not [m for m in owner.messages if m["type"] == "error"]
