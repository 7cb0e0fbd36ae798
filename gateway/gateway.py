"""`Gateway`: everything one app owns and its handlers share (backend, store, metrics, admission, state).

Its own module so that the app factory (gateway/app.py) and the code its routes run (gateway/http/routes.py,
gateway/http/guard.py) both import it: routes.py and guard.py need not import app.py, which
imports them (tests/test_import_cycles.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tts_backend.base import Synthesizer, UnknownVoiceError

from .auth import Authenticator
from .compat import resolve_voice
from .limits import Admission
from .metrics import GatewayMetrics
from .pronunciation.registry import PronunciationRegistry
from .protocol import ProtocolError
from .session.connection import StreamingSession
from .settings import GatewaySettings
from .store.base import SessionStore
from .voices import VoiceRegistry


@dataclass
class Gateway:
    settings: GatewaySettings
    backend: Synthesizer
    store: SessionStore
    metrics: GatewayMetrics
    authenticate: Authenticator
    admission: Admission
    voices: VoiceRegistry
    pronunciations: PronunciationRegistry
    started_at: float = field(default_factory=time.time)
    draining: bool = False  # set while shutting down (issue 5): /ready says no, new sessions are refused
    backend_error: BaseException | None = None
    store_error: BaseException | None = None  # the session store could not start (Redis unreachable)
    sessions: set[StreamingSession] = field(default_factory=set)
    shared_voices_pending: bool = False  # the operator's shared voices are still being cloned at start-up

    @property
    def ready(self) -> bool:
        """The backend is loaded and warm, and the gateway is not shutting down."""
        return (self.backend.ready and self.failure is None and not self.draining
                and not self.shared_voices_pending)

    @property
    def default_voice(self) -> str:
        """The backend's id of the default voice: a --voice is matched as sessions match names (any case, an
        alias), so the catalogue names a voice that is in its own list."""
        try:
            return resolve_voice(self.backend, self.settings, None).voice
        except ProtocolError:  # start-up refuses such a --voice (check_default_voice); until then, as given
            return self.settings.voice or self.backend.default_voice

    @property
    def failure(self) -> str | None:
        """Why this gateway will never serve (its store or backend failed to start), in one line; None
        while it is starting or serving."""
        if self.store_error is not None:
            return f"the {self.settings.store} session store cannot start: {self.store_error}"
        if self.backend_error is None:
            return None
        if isinstance(self.backend_error, UnknownVoiceError):
            return str(self.backend_error)
        return f"the {self.backend.name} backend failed to start: {self.backend_error}"

    def check_default_voice(self) -> None:
        """A --voice the started backend does not have fails start-up, rather than every session."""
        if self.settings.voice is None:
            return
        try:
            resolve_voice(self.backend, self.settings, None)
        except ProtocolError as unknown:
            self.backend_error = UnknownVoiceError(f"--voice / VOXGATE_VOICE: {unknown}")
