"""Cloned voices: one registry behind the WebSocket's voice.add / voice.list, the HTTP voice routes, and
`voice: "<name>"` in session.config and POST /v1/audio/speech (issue 15).

A voice is cloned once: the reference clip is decoded in a decoder process (gateway/audio/decoder.py;
fetched first by gateway/audio/fetch.py where it is a URL), the backend computes
its voice prompt (`Synthesizer.clone_voice`), and the prompt is stored with its metadata (owner key
fingerprint, consent, created time, size, ...) in the session store, so with `--store redis` every replica
can use it at once. Each replica keeps the prompts it used lately in an LRU cache bounded in bytes
(`voice_cache_bytes`), keyed by the voice's id: a lookup reads only the small metadata from the store
(so a deletion or replacement anywhere is seen at once) and the prompt only on a cache miss.

Isolation: a voice belongs to the API key that created it (its fingerprint; '' on a server without keys).
Another key finds nothing under that name: it can neither use, list, get nor delete it. Shared voices,
cloned at start-up from `shared_voices_dir`, are visible to every key and deleted by none; a key's own
voice of the same name comes first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tts_backend.base import REFERENCE_SAMPLE_RATE, ReferenceAudio, SynthesisError, Synthesizer

from .auth import Principal
from .compat import backend_voice
from .limits import Admission, LimitExceeded
from .protocol import ErrorCode, ProtocolError, backend_error_code
from .audio.decoder import DecoderBusy, DecoderFailed, ReferenceDecoder
from .audio.fetch import ReferenceFetcher
from .audio.reference import InvalidReferenceAudio, decode_base64_audio, url_scheme
from .settings import GatewaySettings
from .store.base import SessionStore

log = logging.getLogger(__name__)

# Matched whole (fullmatch): with match() and "$", a name with a final newline would pass as another voice.
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_CONSENT_CHARS = 256
MAX_REF_TEXT_CHARS = 2000
SHARED_AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")
# One key's clones in progress at once on a replica, whatever their path (registrations, and ref_audio in
# session.config and HTTP speech): each holds a clip and, while it decodes, one of the few decoder processes.
CLONES_PER_KEY = 2
# What of a voice's metadata clients see (vLLM-Omni's uploaded_voices fields and ours).
PUBLIC_FIELDS = ("name", "consent", "created_at", "size", "file_size", "duration_s", "ref_text", "x_vector_only",
                 "shared")


@dataclass(frozen=True)
class RegisteredVoice:
    name: str
    prompt: bytes
    meta: dict[str, Any]


def public(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in PUBLIC_FIELDS if meta.get(k) is not None}


class PromptCache:
    """Voice prompts by voice id, least recently used first out once they pass `max_bytes` together."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._prompts: OrderedDict[str, bytes] = OrderedDict()

    def get(self, voice_id: str) -> bytes | None:
        prompt = self._prompts.get(voice_id)
        if prompt is not None:
            self._prompts.move_to_end(voice_id)
        return prompt

    def put(self, voice_id: str, prompt: bytes) -> None:
        self.drop(voice_id)
        if len(prompt) > self.max_bytes:
            return
        self._prompts[voice_id] = prompt
        self.bytes += len(prompt)
        while self.bytes > self.max_bytes:
            _, oldest = self._prompts.popitem(last=False)
            self.bytes -= len(oldest)

    def drop(self, voice_id: str) -> None:
        old = self._prompts.pop(voice_id, None)
        if old is not None:
            self.bytes -= len(old)

    def __len__(self) -> int:
        return len(self._prompts)


class VoiceRegistry:
    def __init__(self, backend: Synthesizer, store: SessionStore, settings: GatewaySettings,
                 admission: Admission | None = None, decoder: ReferenceDecoder | None = None) -> None:
        self.backend = backend
        self.admission = admission  # a registration counts as a request of its key (rate, overload)
        self.store = store
        self.settings = settings
        self.cache = PromptCache(settings.voice_cache_bytes)
        self._shared: dict[str, RegisteredVoice] = {}
        # Clips are decoded in processes of their own (a decoder crash costs one clip), URLs fetched apart.
        self.decoder = decoder or ReferenceDecoder()
        self.fetcher = ReferenceFetcher(max_bytes=settings.max_reference_audio_bytes,
                                        timeout_s=settings.reference_fetch_timeout_s,
                                        allowed_networks=settings.reference_fetch_allowed_networks)
        self._cloning: Counter[str] = Counter()  # clones in progress per owner

    async def stop(self) -> None:
        await self.decoder.stop()

    @staticmethod
    def owner(principal: Principal) -> str:
        return principal.key_id or ""

    def _check_can_clone(self) -> None:
        if not self.backend.can_clone:
            raise ProtocolError(ErrorCode.voice_cloning_unsupported,
                                f"the {self.backend.name} backend cannot clone a voice from reference audio")

    @contextlib.asynccontextmanager
    async def _admitted(self, principal: Principal, admitted: bool) -> AsyncIterator[None]:
        """A clone counts as a request of its key (rate, overload), whatever asked for it, unless it is part
        of work already admitted (a new session's first config, an HTTP speech request): a session that
        re-configures itself with a new clip 30 times is 30 requests, not one."""
        if admitted or self.admission is None:
            yield
            return
        claim = await self.admission.admit_request(principal, 0)
        try:
            yield
        finally:
            claim.release()

    async def clone(self, principal: Principal, audio: str | bytes, ref_text: str | None, x_vector_only: bool, *,
                    admitted: bool) -> tuple[ReferenceAudio, bytes]:
        """Decode a clip and have the backend compute its prompt (a session's inline clone, or a voice to
        register). `admitted`: the caller's admission already counted this clone. Raises ProtocolError
        with invalid_reference_audio, voice_cloning_unsupported, ... and LimitExceeded."""
        self._check_can_clone()
        if ref_text is not None and len(ref_text) > MAX_REF_TEXT_CHARS:
            raise ProtocolError(ErrorCode.invalid_reference_audio,
                                f"ref_text has {len(ref_text)} characters; the limit is {MAX_REF_TEXT_CHARS}")
        async with self._admitted(principal, admitted):
            try:
                reference = await self._reference(audio, ref_text)
            except InvalidReferenceAudio as exc:
                raise ProtocolError(ErrorCode.invalid_reference_audio, str(exc)) from None
            try:
                return reference, await self.backend.clone_voice(reference, x_vector_only)
            except SynthesisError as exc:
                raise ProtocolError(backend_error_code(exc) or ErrorCode.synthesis_failed,
                                    f"cloning the voice: {exc}") from None

    async def _reference(self, audio: str | bytes, ref_text: str | None) -> ReferenceAudio:
        """A client's clip (a ref_audio string, or the bytes of an uploaded file) as the backend takes it."""
        settings = self.settings
        max_bytes, min_s, max_s = settings.max_reference_audio_bytes, settings.min_reference_audio_s, settings.max_reference_audio_s
        if isinstance(audio, bytes):
            data = audio
        elif (scheme := url_scheme(audio)) in ("http", "https"):
            if not settings.reference_audio_fetch:
                raise InvalidReferenceAudio("this server does not fetch reference audio from URLs; send it as base64"
                                            " or a data URL")
            data = await self.fetcher.fetch(audio)
        elif scheme is not None:
            raise InvalidReferenceAudio("ref_audio must be base64, a base64 data URL or an http(s) URL")
        else:
            data = decode_base64_audio(audio, max_bytes)
        if len(data) > max_bytes:
            raise InvalidReferenceAudio(f"the reference audio is larger than {max_bytes} bytes")
        try:
            samples = await self.decoder.decode(data, min_s, max_s, REFERENCE_SAMPLE_RATE)
        except DecoderFailed as failed:
            raise InvalidReferenceAudio(failed.refusal or "the reference audio cannot be decoded") from None
        except DecoderBusy:
            raise LimitExceeded(ErrorCode.overloaded, "every reference audio decoder is busy; retry shortly",
                                retry_after_s=5.0) from None
        # The decoder's answer is bounded in size; its values are checked here as the decoder checks them.
        if len(samples) < min_s * REFERENCE_SAMPLE_RATE or not np.all(np.isfinite(samples)):
            raise InvalidReferenceAudio("the reference audio cannot be decoded")
        text = ref_text.strip() if ref_text else None
        return ReferenceAudio(np.clip(samples, -1.0, 1.0).astype("<f4").tobytes(), text or None)

    async def voice_for(self, principal: Principal, *, voice: str | None, ref_audio: str | None,
                        ref_text: str | None, x_vector_only: bool | None,
                        task_type: str | None, admitted: bool) -> RegisteredVoice | None:
        """The cloned voice a request speaks with, if any (else the backend's presets, gateway/compat.py):
        its own clip (`ref_audio`, cloned for this request or session), else the caller's or a shared
        voice named `voice` unless a preset has that name. Where only a clone can speak (task_type "Base",
        or a backend that speaks only clones) no voice, or a name that is none of these, is
        voice_not_found; elsewhere the preset rules apply (fallback or unknown_voice). Backends that
        cannot clone: None (compat warns about the cloning fields). `admitted`: the caller's admission
        counts a clone of `ref_audio` (see clone), which is one of the key's clones in progress
        (LimitExceeded beyond CLONES_PER_KEY)."""
        if not self.backend.can_clone:
            return None
        if ref_audio is not None:
            with self._clone_in_progress(principal):
                _, prompt = await self.clone(principal, ref_audio, ref_text, bool(x_vector_only), admitted=admitted)
            return RegisteredVoice(voice or "ref_audio", prompt, {})
        only_clones = task_type == "Base" or self.backend.speaks_only_clones
        if not voice:
            if only_clones:
                raise ProtocolError(ErrorCode.voice_not_found, "this backend speaks only cloned voices: name one"
                                    " (voice) or send ref_audio")
            return None
        if not self.backend.speaks_only_clones and backend_voice(self.backend, voice) is not None:
            return None
        found = await self.find(principal, voice)
        if found is None and only_clones:
            raise ProtocolError(ErrorCode.voice_not_found, f"no voice {voice!r} {_registered_for(principal)};"
                                " register it (voice.add, POST /v1/audio/voices) or send ref_audio")
        return found

    @contextlib.asynccontextmanager
    async def registering(self, principal: Principal) -> AsyncIterator["Registration"]:
        """What a registration must pass before its clip is even read (an HTTP upload's body is parsed only
        inside): the backend clones, the key may have voices at all, it has fewer than CLONES_PER_KEY clones
        in progress on this replica (each holds a clip of up to max_reference_audio_bytes and a decode), and
        the key's request rate and the load let it through.
        Whether the key is at its voice limit depends on the name (a registration under a name it has
        replaces that voice): checked by Registration.add once the name is known, before the clip is
        decoded."""
        self._check_can_clone()
        if self.settings.max_voices_per_key == 0:
            raise self._limit()
        with self._clone_in_progress(principal):
            async with self._admitted(principal, admitted=False):
                yield Registration(functools.partial(self._register, principal))

    @contextlib.contextmanager
    def _clone_in_progress(self, principal: Principal) -> Iterator[None]:
        """One of the key's CLONES_PER_KEY clones in progress on this replica, else LimitExceeded
        (rate_limited) at once: one key's clips cannot queue for the decoders ahead of every other key's."""
        owner = self.owner(principal)
        if self._cloning[owner] >= CLONES_PER_KEY:
            raise LimitExceeded(ErrorCode.rate_limited, f"this key already has {CLONES_PER_KEY} voice clones in"
                                " progress; wait for one to finish", retry_after_s=1.0)
        self._cloning[owner] += 1
        try:
            yield
        finally:
            self._cloning[owner] -= 1
            if not self._cloning[owner]:
                del self._cloning[owner]

    async def add(self, principal: Principal, name: Any, audio: str | bytes, *, consent: Any,
                  ref_text: str | None = None, x_vector_only: bool = False) -> dict[str, Any]:
        """Register (or replace) the caller's voice `name` from a clip already in memory (voice.add);
        returns its public metadata."""
        async with self.registering(principal) as registration:
            return await registration.add(name, audio, consent=consent, ref_text=ref_text,
                                          x_vector_only=x_vector_only)

    async def _register(self, principal: Principal, name: Any, audio: str | bytes, *, consent: Any,
                        ref_text: str | None, x_vector_only: bool) -> dict[str, Any]:
        if not isinstance(name, str) or not VOICE_NAME.fullmatch(name):
            raise ProtocolError(ErrorCode.invalid_message, "a voice name is 1-64 letters, digits, '_', '-' or '.',"
                                " starting with a letter or digit")
        if not isinstance(consent, str) or not consent.strip() or len(consent) > MAX_CONSENT_CHARS:
            raise ProtocolError(ErrorCode.invalid_message, "consent is required: a non-empty string of at most"
                                f" {MAX_CONSENT_CHARS} characters naming the speaker's consent (a recording id)")
        owner = self.owner(principal)
        # Checked before the costly clone, and again atomically by the store when the voice is written.
        existing = await self.store.voice_metas(owner)
        if not any(m["name"] == name for m in existing) and len(existing) >= self.settings.max_voices_per_key:
            raise self._limit()
        size = len(audio)
        reference, prompt = await self.clone(principal, audio, ref_text, x_vector_only, admitted=True)
        meta = {"id": uuid.uuid4().hex, "name": name, "owner": owner, "consent": consent,
                "created_at": int(time.time()), "size": len(prompt), "file_size": size,
                "duration_s": round(reference.duration_s, 3), "ref_text": reference.ref_text,
                "x_vector_only": bool(x_vector_only), "backend": self.backend.name}
        if not await self.store.put_voice(owner, name, meta, prompt, self.settings.max_voices_per_key):
            raise self._limit()
        self.cache.put(meta["id"], prompt)
        log.info("voice registered", extra={"key_id": principal.key_id, "voice": name, "prompt_bytes": len(prompt)})
        return public(meta)

    def _limit(self) -> ProtocolError:
        return ProtocolError(ErrorCode.voice_limit_reached, f"this key has {self.settings.max_voices_per_key} voices,"
                             " the most it may register; delete one first")

    async def find(self, principal: Principal, name: str) -> RegisteredVoice | None:
        """The caller's voice `name`, or the shared one; None if neither exists (or it is another key's)."""
        if not VOICE_NAME.fullmatch(name):
            return None
        owner = self.owner(principal)
        meta = await self.store.voice_meta(owner, name)
        if meta is None:
            return self._shared.get(name)
        prompt = self.cache.get(meta["id"])
        if prompt is None:
            prompt = await self.store.voice_prompt(owner, name)
            if prompt is None:  # deleted between the two reads
                return self._shared.get(name)
            self.cache.put(meta["id"], prompt)
        return RegisteredVoice(name, prompt, meta)

    async def list_voices(self, principal: Principal) -> list[dict[str, Any]]:
        own = await self.store.voice_metas(self.owner(principal))
        names = {m["name"] for m in own}
        shared = [v.meta for name, v in self._shared.items() if name not in names]
        return [public(m) for m in sorted(own, key=lambda m: m["name"]) + shared]

    async def get(self, principal: Principal, name: str) -> dict[str, Any]:
        meta = await self.store.voice_meta(self.owner(principal), name) if VOICE_NAME.fullmatch(name) else None
        if meta is None and name in self._shared:
            meta = self._shared[name].meta
        if meta is None:
            raise self._not_found(name, principal)
        return public(meta)

    async def delete(self, principal: Principal, name: str) -> None:
        owner = self.owner(principal)
        meta = await self.store.voice_meta(owner, name) if VOICE_NAME.fullmatch(name) else None
        if meta is None or not await self.store.delete_voice(owner, name):
            raise self._not_found(name, principal)
        self.cache.drop(meta["id"])

    @staticmethod
    def _not_found(name: str, principal: Principal) -> ProtocolError:
        return ProtocolError(ErrorCode.voice_not_found, f"no voice {name!r} {_registered_for(principal)}")

    async def load_shared(self, folder: str) -> None:
        """Clone every clip of `folder` (NAME.wav/.flac/.mp3/.ogg, its transcript in NAME.txt, else an
        x-vector-only voice) into a shared voice. A clip that cannot be cloned fails start-up."""
        for path in sorted(Path(folder).iterdir()):
            if path.suffix.lower() not in SHARED_AUDIO_SUFFIXES:
                continue
            name = path.stem
            if not VOICE_NAME.fullmatch(name):
                raise ValueError(f"shared voice file {path}: {name!r} is not a valid voice name")
            transcript = path.with_suffix(".txt")
            ref_text = transcript.read_text(encoding="utf-8").strip() if transcript.exists() else None
            data = path.read_bytes()
            try:
                reference, prompt = await self.clone(Principal(), data, ref_text, x_vector_only=ref_text is None,
                                                     admitted=True)  # the operator's, at start-up
            except ProtocolError as exc:
                raise ValueError(f"shared voice file {path}: {exc.message}") from None
            meta = {"id": f"shared:{name}", "name": name, "owner": None, "consent": "operator",
                    "created_at": int(path.stat().st_mtime), "size": len(prompt), "file_size": len(data),
                    "duration_s": round(reference.duration_s, 3), "ref_text": reference.ref_text,
                    "x_vector_only": ref_text is None, "shared": True, "backend": self.backend.name}
            self._shared[name] = RegisteredVoice(name, prompt, meta)
        log.info("%d shared voices loaded from %s", len(self._shared), folder)


class Registration:
    """A registration that VoiceRegistry.registering let through: `add` checks the name, the consent and
    the key's voice limit, then clones and stores the voice."""

    def __init__(self, register: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        self._register = register

    async def add(self, name: Any, audio: str | bytes, *, consent: Any, ref_text: str | None = None,
                  x_vector_only: bool = False) -> dict[str, Any]:
        return await self._register(name, audio, consent=consent, ref_text=ref_text, x_vector_only=x_vector_only)


def _registered_for(principal: Principal) -> str:
    """Where a voice name was looked for, as an error says it: a gateway without API keys has no "key"."""
    return "registered with this key" if principal.key_id is not None else "registered on this gateway"
