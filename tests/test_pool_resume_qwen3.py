"""Resume from codes through the worker pool with the real Qwen3 engine (issue 33): two `voxgate worker`
processes serving the tiny random checkpoint on the CPU (stateless sampler), the one speaking killed after a
random number of chunks. The pool goes on from the delivered codes on the other worker (not made again: its
engine is handed those frames), and the listener's audio is the uninterrupted run's, byte for byte: through the
pool alone, and through a real gateway whose sessions are in Redis."""

from __future__ import annotations

import random

from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - session fixture
from tests.redis_fixtures import redis_prefix  # noqa: F401 (fixture)
from tests.worker_fixtures import pool, token_file, workers  # noqa: F401 (fixture)
from tts_backend.base import SynthesisRequest
from tts_backend.registry import create_backend

TEXT = "Hello world, this is a small test of the engine, long enough to be cut while it is speaking."
OPTIONS = {"max_active": 2, "max_len": 640, "sampler": "stateless", "trim_leading_silence": False}


def qwen3_worker_args(model, token_file: str) -> tuple[str, ...]:
    args = ["--backend", "qwen3", "--model", str(model), "--device", "cpu", "--listen", "tcp://127.0.0.1:0",
            "--token-file", token_file]
    for key, value in OPTIONS.items():
        args += ["--option", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return tuple(args)


async def test_a_qwen3_worker_killed_mid_sentence_goes_on_from_its_codes(tiny_custom_voice, token_file):  # noqa: F811
    request = SynthesisRequest(text=TEXT, voice="ryan", seed=11, max_new_tokens=600, session_key="s",
                               utterance_key="s/0", request_id="s/0")
    local = create_backend("qwen3", model=str(tiny_custom_voice), device="cpu", **OPTIONS)
    await local.start()
    try:
        whole = [(c.pcm, c.codes) async for c in local.synthesize(request)]
    finally:
        await local.stop()
    cut_at = random.Random().randrange(1, len(whole) // 2)  # chunks the listener has before the kill
    print(f"killing the worker after {cut_at} chunks of {len(whole)}")
    args = qwen3_worker_args(tiny_custom_voice, token_file)
    with workers(args, args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        await remote.start()
        try:
            assert "resume_codes" in remote.honours and remote.codebooks == local.codebooks
            received, chunks, codes_seen, killed = bytearray(), 0, 0, False
            async for chunk in remote.synthesize(request):
                received += chunk.pcm
                chunks += 1
                codes_seen += len(chunk.codes)
                # A chunk's audio may come before its codes (codes of frames the leading-silence trimmer held
                # ride with later audio, base.py): a cut before any codes came makes the sentence again from
                # its start, by design. The cut waits for the first codes, so it always goes on from codes.
                if chunks >= cut_at and codes_seen and not killed:
                    serving = [m for m in remote.members.values() if m.streams]
                    assert len(serving) == 1
                    by_id[serving[0].id].kill()
                    killed = True
            assert killed
            assert bytes(received) == b"".join(pcm for pcm, _ in whole)
            assert remote.failovers == 1 and remote.resumed_from_codes == 1
        finally:
            await remote.stop()


async def test_through_a_gateway_with_redis_the_listener_hears_one_take(tiny_custom_voice, token_file,  # noqa: F811
                                                                       redis_prefix):  # noqa: F811
    """A real gateway whose sessions are in Redis, over a pool of two qwen3 workers: a session's sentence, cut by
    a worker's death after a random number of audio frames, reaches the client as the uninterrupted session's
    sentence, byte for byte, and the store held the codes delivered."""

    from gateway.store.redis import RedisSessionStore
    from tests.gateway_server import running_gateway, speak_first_sentence
    from tests.redis_fixtures import REDIS_URL

    config = {"type": "session.config", "voice": "ryan", "response_format": "pcm", "seed": 11, "stream_audio": True}

    args = qwen3_worker_args(tiny_custom_voice, token_file)
    with workers(args, args) as procs:
        by_id = {w.worker_id: w for w in procs}
        remote = pool(*(w.address for w in procs))
        with running_gateway(remote, store="redis", redis_url=REDIS_URL, redis_key_prefix=redis_prefix) as gateway:
            whole, _ = await speak_first_sentence(gateway.ws_url, config, TEXT, 60)
            cut_at = random.Random().randrange(2, 7)  # of some 15 chunks: well before the worker finishes
            print(f"killing the worker after {cut_at} audio frames")

            async def kill(session_id: str) -> None:
                serving = [m for m in remote.members.values() if m.streams]
                assert len(serving) == 1
                by_id[serving[0].id].kill()
                store = RedisSessionStore(REDIS_URL, key_prefix=redis_prefix)
                await store.start()
                try:
                    sentence = (await store.get(session_id)).sentences[0]
                finally:
                    await store.stop()
                assert sentence.codes and len(sentence.codes) % (2 * remote.codebooks) == 0

            cut, _ = await speak_first_sentence(gateway.ws_url, config, TEXT, 60, (cut_at, kill))
            assert cut == whole
            assert remote.failovers == 1 and remote.resumed_from_codes == 1
