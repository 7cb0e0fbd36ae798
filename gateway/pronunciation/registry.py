"""Pronunciation dictionaries registered by name, per API key, in the session store (so with `--store redis`
every replica has them at once, as cloned voices are): `POST/GET/DELETE /v1/audio/pronunciations` and the
WebSocket's pronunciation.add/.list/.delete. A dictionary belongs to the key that registered it (its
fingerprint; '' on a server without keys): another key finds nothing under that name.

`pronouncer` resolves what a session.config or speech request names (`pronunciations`: entries, and names
of registered dictionaries, in order) and `text_markup` into the `Pronouncer` it speaks with. The names
are read once, there: a session records the resolved rules, so its resume on another replica applies the
same ones whatever happened to the dictionaries since.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from pydantic import ValidationError

from ..auth import Principal
from ..protocol import ErrorCode, PronunciationEntry, ProtocolError
from ..store.base import SessionStore
from .pronouncer import Pronouncer
from .rules import (
    MAX_DICTIONARIES_PER_KEY,
    MAX_ENTRIES,
    MAX_KEY_BYTES,
    Rule,
    limit_reached,
    rules_from_json,
    rules_of,
    size_of,
)

DICTIONARY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PUBLIC_FIELDS = ("name", "entries", "bytes", "created_at")
BUILT_IN_THREAD_BYTES = 16 * 1024


def _owner(principal: Principal) -> str:
    return principal.key_id or ""


def _not_found(name: str) -> ProtocolError:
    return ProtocolError(ErrorCode.pronunciation_not_found, f"no pronunciation dictionary {name!r} registered with"
                         " this key")


class PronunciationRegistry:
    def __init__(self, store: SessionStore) -> None:
        self.store = store

    async def add(self, principal: Principal, name: str, entries: list[PronunciationEntry]) -> dict[str, Any]:
        """Register (or replace) the caller's dictionary `name`; returns its metadata."""
        if not DICTIONARY_NAME.fullmatch(name):
            raise ProtocolError(ErrorCode.pronunciation_invalid, "a dictionary name is 1-64 letters, digits, '_',"
                                " '-' or '.', starting with a letter or digit")
        rules = rules_of(entries, f"dictionary {name!r}")
        if not rules:
            raise ProtocolError(ErrorCode.pronunciation_invalid, f"dictionary {name!r} has no entries")
        size = size_of(rules)
        meta = {"name": name, "entries": len(rules), "bytes": size, "created_at": int(time.time())}
        stored = await self.store.put_dictionary(_owner(principal), name, meta,
                                                 json.dumps([r.to_json() for r in rules]),
                                                 MAX_DICTIONARIES_PER_KEY, MAX_KEY_BYTES)
        if stored == 0:
            raise limit_reached(f"this key has {MAX_DICTIONARIES_PER_KEY} pronunciation dictionaries, the most it"
                                " may register; delete one first")
        if stored < 0:
            raise limit_reached(f"this key's pronunciation dictionaries would take more than {MAX_KEY_BYTES} bytes;"
                                " delete or shorten one first")
        return meta

    async def list(self, principal: Principal) -> list[dict[str, Any]]:
        metas = await self.store.dictionary_metas(_owner(principal))
        return sorted((_public(m) for m in metas), key=lambda m: m["name"])

    async def get(self, principal: Principal, name: str) -> dict[str, Any]:
        """The dictionary's metadata and its entries."""
        found = await self.store.dictionary(_owner(principal), name) if DICTIONARY_NAME.fullmatch(name) else None
        if found is None:
            raise _not_found(name)
        meta, entries = found
        return {**_public(meta), "entries": json.loads(entries)}

    async def delete(self, principal: Principal, name: str) -> None:
        if not DICTIONARY_NAME.fullmatch(name) or not await self.store.delete_dictionary(_owner(principal), name):
            raise _not_found(name)

    async def pronouncer(self, principal: Principal, items: list[Any] | None, markup: str | None) -> Pronouncer | None:
        """What a session or request speaks with: None when it asks for nothing (the text goes as written).
        `items`: `pronunciations` as the client sent it (entries and names, JSON values), checked here, its
        length first. Inline entries are bounded as one dictionary is, names by a key's dictionaries, all the
        rules together as a key's dictionaries are."""
        if not items and markup is None:
            return None
        items = items or []
        if len(items) > MAX_ENTRIES + MAX_DICTIONARIES_PER_KEY:
            raise limit_reached(f"pronunciations has {len(items)} items; at most {MAX_ENTRIES} entries and"
                                f" {MAX_DICTIONARIES_PER_KEY} dictionary names")
        names = [item for item in items if isinstance(item, str)]
        if len(names) > MAX_DICTIONARIES_PER_KEY:
            raise limit_reached(f"pronunciations names {len(names)} dictionaries; at most {MAX_DICTIONARIES_PER_KEY}")
        parsed: list[PronunciationEntry | str] = []
        for n, item in enumerate(items):
            if isinstance(item, str):
                parsed.append(item)
                continue
            try:
                parsed.append(PronunciationEntry.model_validate(item))
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                raise ProtocolError(ErrorCode.pronunciation_invalid, f"pronunciations[{n}]: {problems or exc}") from None
        inline_rules = iter(rules_of([p for p in parsed if isinstance(p, PronunciationEntry)], "pronunciations"))
        rules: list[Rule] = []
        for item in parsed:
            if isinstance(item, PronunciationEntry):
                rules.append(next(inline_rules))
                continue
            found = await self.store.dictionary(_owner(principal), item) if DICTIONARY_NAME.fullmatch(item) else None
            if found is None:
                raise _not_found(item)
            rules.extend(rules_from_json(json.loads(found[1])))
        if size_of(rules) > MAX_KEY_BYTES:
            raise limit_reached(f"the pronunciation rules named take more than {MAX_KEY_BYTES} bytes together")
        return await _built(tuple(rules), markup)

    @staticmethod
    async def recorded(rules: list[dict[str, Any]], markup: str | None) -> Pronouncer:
        """The pronunciation a session recorded (Pronouncer.entries, checked when it was first resolved)."""
        return await _built(rules_from_json(rules), markup)


async def _built(rules: tuple[Rule, ...], markup: str | None) -> Pronouncer:
    if size_of(rules) > BUILT_IN_THREAD_BYTES:  # a large trie takes up to about 0.2 s: off the event loop
        return await asyncio.to_thread(Pronouncer, rules, markup == "ssml")
    return Pronouncer(rules, markup == "ssml")


def _public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in PUBLIC_FIELDS if k in meta}
