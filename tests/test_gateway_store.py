"""The in-memory SessionStore: sentence records, the bounded replay log, expiry."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from gateway.store.base import ReplayOutOfRange
from gateway.store.memory import MemorySessionStore
from gateway.store.factory import create_store


async def filled_store(replay_log_bytes=1000):
    store = MemorySessionStore(ttl_s=60, replay_log_bytes=replay_log_bytes)
    await store.create("s1", {"voice": "v"})
    for index, text in enumerate(["Zero.", "One.", "Two."]):
        await store.add_sentence("s1", index, text, None)
        await store.set_sentence_state("s1", index, "speaking")
        for piece in range(3):
            await store.append_audio("s1", index, bytes([index * 10 + piece]) * 100, offset=piece * 100)
        await store.set_sentence_state("s1", index, "done")
    return store


async def test_records_sentences_states_and_bytes():
    store = await filled_store()
    record = await store.get("s1")
    assert record.config == {"voice": "v"}
    assert [(s.text, s.state, s.bytes_sent) for s in record.sentences.values()] == [
        ("Zero.", "done", 300), ("One.", "done", 300), ("Two.", "done", 300)
    ]
    await store.update_config("s1", {"voice": "w"})
    assert (await store.get("s1")).config == {"voice": "w"}


async def test_replay_returns_exactly_what_follows_a_position():
    store = await filled_store()
    pieces = await store.replay("s1", 1, 150)
    assert [(p.sentence_index, p.offset, len(p.data)) for p in pieces] == [
        (1, 150, 50), (1, 200, 100), (2, 0, 100), (2, 100, 100), (2, 200, 100)
    ]
    assert pieces[0].data == bytes([11]) * 50
    assert await store.replay("s1", 2, 300) == []


async def test_replay_log_is_bounded_and_old_positions_are_out_of_range():
    store = await filled_store(replay_log_bytes=450)
    with pytest.raises(ReplayOutOfRange):
        await store.replay("s1", 0, 0)
    # 400 bytes are kept: sentence 1 from byte 200 on, and all of sentence 2.
    assert [(p.sentence_index, p.offset) for p in await store.replay("s1", 1, 250)] == [(1, 250), (2, 0), (2, 100), (2, 200)]
    with pytest.raises(ReplayOutOfRange):
        await store.replay("s1", 1, 150)
    with pytest.raises(ReplayOutOfRange):
        await store.replay("s1", 2, 301)  # never sent


async def test_detached_sessions_expire_after_their_ttl():
    store = MemorySessionStore(ttl_s=10)
    await store.create("gone", {})
    await store.create("kept", {})
    await store.detach("gone")
    assert store.expire(now=time.monotonic() + 5) == []
    assert store.expire(now=time.monotonic() + 11) == ["gone"]
    assert await store.get("gone") is None and await store.get("kept") is not None
    await store.delete("kept")
    assert len(store) == 0


def test_create_store_names():
    assert isinstance(create_store("memory", ttl_s=1, replay_log_bytes=1), MemorySessionStore)
    with pytest.raises(ValueError):
        create_store("disk", ttl_s=1, replay_log_bytes=1)


def gateway_imports(module: str) -> set[str]:
    """The gateway/store modules `module` imports, at its top or inside a function."""
    source = (Path(__file__).parent.parent / "gateway" / "store" / f"{module}.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            imported |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gateway.store."):
            imported.add(node.module.removeprefix("gateway.store."))
    return imported


def test_the_store_modules_import_one_way():
    """factory -> memory, redis -> base: the interface knows no implementation of it, and neither
    implementation knows the other or the factory."""
    assert gateway_imports("base").isdisjoint({"memory", "redis", "factory"})
    assert gateway_imports("memory").isdisjoint({"redis", "factory"})
    assert gateway_imports("redis").isdisjoint({"memory", "factory"})
    assert {"base", "memory", "redis"} <= gateway_imports("factory")
