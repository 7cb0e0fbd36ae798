"""Cloned voices over the gateway's HTTP API: `add_voice`, `list_voices`, `delete_voice`.

A voice registered with an API key is that key's alone, on every replica of the gateway; then
`SessionConfig(voice=name)` speaks with it. Plain HTTP from the standard library (run on a worker thread),
so the client needs nothing beyond `websockets`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from .session import VoxgateError

TIMEOUT_S = 60.0  # cloning computes the voice's prompt before the answer


def _http_base(url: str) -> str:
    """http(s)://host:port of a gateway URL given as ws(s):// or http(s)://, with or without a path."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


def _call(url: str, path: str, *, api_key: str | None, method: str = "GET", body: dict | None = None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(_http_base(url) + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - the caller's gateway
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            error = json.loads(exc.read())["error"]
            message, code = error.get("message", str(exc)), error.get("code")
        except (ValueError, KeyError, TypeError):
            message, code = str(exc), None
        raise VoxgateError(f"{method} {path}: {message}", code=code,
                           retryable=exc.code == 429 or exc.code >= 500) from None
    except urllib.error.URLError as exc:
        raise VoxgateError(f"{method} {path}: {exc.reason}", code="internal", retryable=True) from None


async def add_voice(url: str, name: str, audio: bytes | str | Path, *, consent: str, ref_text: str | None = None,
                    x_vector_only: bool = False, api_key: str | None = None) -> dict[str, Any]:
    """Clone a voice from a reference clip (bytes or a file path; wav, flac, mp3, ogg, any rate) and register
    it as `name` for this API key (registering a name again replaces it). `consent`: the speaker's consent
    (e.g. a recording id). `ref_text`: what the clip says, needed unless `x_vector_only`. Returns the voice's
    metadata. Raises VoxgateError: invalid_reference_audio, voice_limit_reached, voice_cloning_unsupported."""
    data = audio if isinstance(audio, bytes) else Path(audio).read_bytes()
    body: dict[str, Any] = {"name": name, "consent": consent, "audio_sample": base64.b64encode(data).decode(),
                            "x_vector_only_mode": x_vector_only}
    if ref_text is not None:
        body["ref_text"] = ref_text
    answer = await asyncio.to_thread(_call, url, "/v1/audio/voices", api_key=api_key, method="POST", body=body)
    return answer["voice"]


async def list_voices(url: str, *, api_key: str | None = None) -> dict[str, Any]:
    """`voices` (names usable as `voice`), `uploaded_voices` (the cloned voices this key may use, with their
    metadata) and `voice_cloning` (whether the gateway's backend can clone)."""
    return await asyncio.to_thread(_call, url, "/v1/audio/voices", api_key=api_key)


async def delete_voice(url: str, name: str, *, api_key: str | None = None) -> None:
    """Delete a voice this API key registered; VoxgateError voice_not_found otherwise."""
    await asyncio.to_thread(_call, url, f"/v1/audio/voices/{quote(name, safe='')}", api_key=api_key, method="DELETE")
