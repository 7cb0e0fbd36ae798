"""Every knob of the gateway in one place, with its default and meaning.

Values come from (highest priority first) `voxgate serve` flags, environment variables prefixed
`VOXGATE_` (e.g. `VOXGATE_PORT=9000`, `VOXGATE_API_KEYS='["k1","k2"]'`), and the defaults below.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal, get_origin

from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

KIB = 1024
MIB = 1024 * KIB

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's; trace: every connection
LogLevel = Annotated[Literal[LOG_LEVELS], BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)]


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VOXGATE_", extra="ignore")

    # --- network
    host: str = Field("127.0.0.1", description="interface to listen on")
    port: int = Field(8000, ge=0, le=65535, description="TCP port")
    log_level: LogLevel = Field("info", description="uvicorn/gateway log level")

    # --- synthesis backend
    backend: str = Field("piper", description="piper (CPU default), synthetic (tests/load), qwen3, remote")
    voice: str | None = Field(None, description="default voice; None = the backend's first voice")
    model: str | None = Field(None, description="model path or name, passed to the backend as `model`")
    device: str | None = Field(None, description="device for the backend (e.g. cuda:0), passed as `device`")
    backend_options: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword options for the backend constructor"
    )
    served_model_name: str = Field("voxgate", description="model id reported by /v1/models and accepted in requests")
    voice_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="requested voice name -> the backend's voice (e.g. voices of other servers: alloy, Vivian)",
    )
    voice_fallback: bool = Field(
        True, description="an unknown voice name gets the default voice and a warning; off: refused (unknown_voice)"
    )

    # --- voice cloning (backends that can clone: a Qwen3 Base checkpoint)
    max_voices_per_key: int = Field(20, ge=0, description="cloned voices one API key may register; 0 = none")
    min_reference_audio_s: float = Field(3.0, gt=0, description="shortest reference clip to clone a voice from")
    max_reference_audio_s: float = Field(30.0, gt=0, description="longest reference clip to clone a voice from")
    max_reference_audio_bytes: int = Field(
        3 * MIB, gt=0, description="largest encoded reference clip (base64 in a WebSocket message also counts against"
        " max_config_bytes)"
    )
    reference_audio_fetch: bool = Field(
        False, description="accept http(s) URLs as ref_audio and fetch them (off: base64 and data URLs only)"
    )
    reference_fetch_timeout_s: float = Field(
        10.0, gt=0, description="time a reference audio URL may take to fetch, redirects included"
    )
    reference_fetch_allowed_networks: list[str] = Field(
        default_factory=list, description="networks (CIDR, e.g. 10.1.2.0/24) a reference audio URL may reach although"
        " they are loopback, private or link-local; every other such address is refused"
    )
    voice_cache_bytes: int = Field(
        64 * MIB, ge=0, description="voice prompts each replica keeps in memory (LRU), beside the session store"
    )
    shared_voices_dir: str | None = Field(
        None, description="folder of reference clips (NAME.wav/.flac/.mp3/.ogg, transcript in NAME.txt) cloned at"
        " start-up into voices every key may use"
    )

    # --- protocol limits (protocol.md, "Errors and limits")
    config_timeout_s: float = Field(10.0, description="time allowed to receive session.config")
    idle_timeout_s: float = Field(30.0, description="close a session that sends nothing for this long")
    max_config_bytes: int = Field(4 * MIB, description="largest session.config message")
    max_message_bytes: int = Field(128 * KIB, description="largest message other than session.config")
    max_buffered_chars: int = Field(100_000, description="text accepted but not yet spoken, per session")
    max_http_input_chars: int = Field(100_000, description="largest `input` of POST /v1/audio/speech")
    max_synthesis_chars: int = Field(
        300, ge=16, description="longest text of one synthesis call, as spoken (a digit counts 8); longer text is split at a sentence end, clause mark"
        " or word (WebSocket, every granularity, and HTTP). Piper's memory grows with it: up to ~1.3 MB per character"
    )

    # --- streaming behaviour
    lookahead_sentences: int = Field(
        2, ge=0, description="sentences synthesized ahead of the one being sent (pipelining depth)"
    )
    synthesis_concurrency: int = Field(
        1, ge=1, description="sentences of one session synthesized at the same time (1: in order, head first)"
    )
    max_frame_ms: int = Field(200, ge=10, description="longest audio per binary frame; bigger chunks are split")
    word_timestamps_wait_s: float = Field(
        1.0, gt=0, le=30, description="longest wait for a sentence's word timings after its audio (a forced"
        " aligner's); past it the sentence ends without them, warning timestamps_late"
    )

    # --- session store (resume, issue 5)
    store: Literal["memory", "redis"] = Field("memory", description="where session state lives")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for store=redis; set alone, it selects store=redis")
    session_ttl_s: float = Field(120.0, description="keep a disconnected session this long for session.resume")
    replay_log_bytes: int = Field(4 * MIB, description="recent audio kept per session for replay on resume")
    replay_log_s: float = Field(300.0, description="oldest audio kept in the replay log, in seconds")
    redis_key_prefix: str = Field("voxgate:", description="prefix of every Redis key (several deployments, one Redis)")
    redis_cluster: bool = Field(
        False, description="redis_url names a node of a Redis Cluster: the store and limits use the cluster client"
    )
    session_lease_s: float = Field(
        10.0, gt=0, description="a replica's lease on a live session; renewed while it works, taken over by a resume"
    )
    drain_timeout_s: float = Field(30.0, description="on SIGTERM, time given to open utterances to finish")

    # --- access and limits (issue 7)
    api_keys: list[str] = Field(default_factory=list, description="accepted API keys; empty = no authentication")
    insecure_no_auth: bool = Field(
        False, description="allow serving a non-loopback host without API keys (anyone who can connect may use it)"
    )
    token_secret: str | None = Field(
        None, description="HMAC secret for POST /v1/tokens tokens; default derived from api_keys (same on every replica)"
    )
    max_token_ttl_s: float = Field(3600.0, gt=0, description="longest lifetime of a minted token")
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser Origins allowed; empty = any with API keys, only loopback pages without them",
    )
    api_docs: bool = Field(False, description="serve /docs, /redoc and /openapi.json (behind the key when keys are set)")
    max_sessions: int = Field(0, ge=0, description="concurrent WebSocket sessions per process; 0 = unlimited")
    max_sessions_per_key: int = Field(
        0, ge=0, description="concurrent sessions per API key, across replicas with store=redis; 0 = unlimited"
    )
    sessions_per_minute: int = Field(0, ge=0, description="new sessions (WebSocket or HTTP speech) per key per minute; 0 = unlimited")
    chars_per_minute: int = Field(0, ge=0, description="text characters accepted per key per minute; 0 = unlimited")

    # --- slow consumers and overload (issue 7)
    max_queued_audio_s: float = Field(
        5.0, gt=0, description="audio made but not yet written to a session's socket; synthesis pauses beyond it"
    )
    slow_consumer_timeout_s: float = Field(
        20.0, gt=0, description="close a session whose socket accepts no audio for this long (it stays resumable)"
    )
    overload_backend_load: float = Field(
        0.95, gt=0, description="refuse new sessions (overloaded) while the backend reports load() at or above this"
    )
    overload_min_realtime: float = Field(
        1.0, ge=0, description="refuse new sessions while the streams running now are made slower than this times real time; 0 = off"
    )
    max_active_synthesis: int = Field(
        0, ge=0, description="refuse new sessions and HTTP speech while this many streams synthesize (counting those"
        " admitted and not started yet); 0 = off"
    )
    admission_hold_s: float = Field(
        5.0, gt=0, description="work admitted under max_active_synthesis counts against it until its synthesis starts,"
        " or for this long"
    )
    max_open_contexts: int = Field(256, ge=1, description="contexts of one session taking text at the same time")
    max_pending_ends: int = Field(
        256, ge=1, description="utterance ends (input.done) of one session queued behind audio not yet sent; another"
        " input.done is refused (rate_limited, retryable) until some have gone out"
    )
    header_timeout_s: float = Field(10.0, gt=0, description="time a client gets to send its request headers (slowloris)")
    max_request_line_bytes: int = Field(
        16 * KIB, ge=256, description="longest HTTP request line (method, URL, version), WebSocket upgrades included;"
        " refused (414) as soon as more arrives"
    )
    max_header_bytes: int = Field(
        64 * KIB, ge=1 * KIB, description="largest HTTP request head (request line and headers), WebSocket upgrades"
        " included, and largest trailer section of a chunked body; refused (431) as soon as more arrives"
    )
    max_http_body_bytes: int = Field(
        1 * MIB, gt=0, description="largest HTTP request body; refused (413) as soon as more arrives"
    )
    http_body_timeout_s: float = Field(
        30.0, gt=0, description="time a client gets to send a whole HTTP request body (slowloris); then 408"
    )
    max_unsent_bytes: int = Field(
        1 * MIB, gt=0,
        description="drop a WebSocket once the replies to its client's frames (pongs) waiting unsent pass this: a"
        " client that pings but reads nothing; the gateway's own audio does not count",
    )
    close_timeout_s: float = Field(
        5.0, gt=0, description="time a fatal error and the close handshake may take; then the TCP connection is dropped"
    )
    send_buffer_bytes: int = Field(
        256 * KIB, ge=0, description="kernel send buffer per connection (bounds what a non-reading client holds); 0 = OS default"
    )

    # --- logs
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="json: one object per line; text: for people; auto: text on a terminal, else json"
    )

    @field_validator("reference_fetch_allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            ipaddress.ip_network(network, strict=False)  # ValueError: one line from settings_error_line
        return value

    @model_validator(mode="after")
    def _redis_url_selects_redis(self) -> GatewaySettings:
        """A Redis URL given without a store means the Redis store, rather than a URL silently unused."""
        if "redis_url" in self.model_fields_set and "store" not in self.model_fields_set:
            self.store = "redis"
        return self


def settings_error_line(error: ValidationError | SettingsError) -> str:
    """One line for a person about settings that cannot be used: which variable, what it needs. Values are
    not repeated (they may be API keys)."""
    if isinstance(error, SettingsError):  # a list or dict variable that is not JSON
        match = re.search(r'field "(\w+)"', str(error))
        fields = [match.group(1)] if match else []
        problems = [" is not valid JSON"] if match else [str(error)]
    else:
        fields = [str(e["loc"][0]) if e["loc"] else "" for e in error.errors()]
        problems = [": " + e["msg"][:1].lower() + e["msg"][1:] for e in error.errors()]
    parts = []
    for field, problem in zip(fields, problems):
        info = GatewaySettings.model_fields.get(field)
        if info is None:
            parts.append(problem)
            continue
        kind = {list: ("a JSON list", '["a", "b"]'), dict: ("a JSON object", '{"name": "value"}')}.get(
            get_origin(info.annotation) or info.annotation)
        hint = f"; it takes {kind[0]}, e.g. VOXGATE_{field.upper()}='{kind[1]}'" if kind else ""
        parts.append(f"VOXGATE_{field.upper()}{problem}{hint}")
    return "invalid settings: " + "; ".join(parts or [str(error)])
