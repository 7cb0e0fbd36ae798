"""`voxgate serve` (the gateway) and `voxgate worker` (a synthesis worker process, tts_backend.remote.worker).

Flags override environment variables (VOXGATE_*), which override the defaults in settings.py.
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import signal
import socket
import sys
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from tts_backend.base import SynthesisError, Synthesizer

from .auth import is_loopback
from .logs import redact
from .settings import LOG_LEVELS, GatewaySettings, settings_error_line
from .transport import abortable_ws_protocol, http_protocol

WS_FRAME_MARGIN = 64 * 1024  # the transport accepts a little more than the largest message we answer


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except ValueError:
        return key.replace("-", "_"), value


def _voice_alias(text: str) -> tuple[str, str]:
    name, sep, voice = text.partition("=")
    if not sep or not name.strip() or not voice.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VOICE, got {text!r}")
    return name.strip(), voice.strip()


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 0 to 65535, got {text!r}")
    return port


def package_version() -> str:
    try:
        return importlib.metadata.version("voxgate")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line (what is wrong, and where help is) and exit status 2, not the usage
    synopsis of every flag followed by the error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="voxgate", description="Real-time streaming TTS gateway")
    parser.add_argument("--version", action="version", version=f"voxgate {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway (HTTP + WebSocket)")
    serve.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, help="TCP port (default 8000)")
    serve.add_argument("--backend", help="piper (default), synthetic, qwen3, remote")
    serve.add_argument("--voice", help="default voice (default: the backend's first)")
    serve.add_argument("--model", help="model path or name for the backend")
    serve.add_argument("--device", help="device for the backend, e.g. cpu or cuda:0")
    serve.add_argument(
        "--option", "-o", action="append", type=_option, default=[], metavar="KEY=VALUE",
        help="extra backend option (JSON value or string); repeatable, e.g. -o noise_scale=0.667",
    )
    serve.add_argument("--served-model-name", help="model id shown by /v1/models")
    serve.add_argument(
        "--voice-alias", dest="voice_aliases", action="append", type=_voice_alias, metavar="NAME=VOICE",
        help="speak requests for voice NAME with the backend's VOICE (repeatable), e.g. --voice-alias alloy=joe",
    )
    serve.add_argument(
        "--no-voice-fallback", dest="voice_fallback", action="store_const", const=False,
        help="refuse unknown voice names (unknown_voice) instead of speaking them with the default voice",
    )
    serve.add_argument("--lookahead-sentences", type=int, help="sentences synthesized ahead (default 2)")
    serve.add_argument("--config-timeout", dest="config_timeout_s", type=float, help="seconds to wait for session.config")
    serve.add_argument("--idle-timeout", dest="idle_timeout_s", type=float, help="idle seconds before a session closes")
    serve.add_argument("--max-buffered-chars", type=int, help="unspoken characters allowed per session")
    serve.add_argument("--max-pending-ends", type=int,
                       help="input.done per session waiting behind unsent audio before more are refused (default 256)")
    serve.add_argument("--max-synthesis-chars", type=int, help="longest text of one synthesis call (default 300)")
    serve.add_argument("--max-sessions", type=int, help="concurrent sessions (0 = unlimited)")
    serve.add_argument("--api-key", dest="api_keys", action="append", help="accepted API key; repeatable")
    serve.add_argument(
        "--insecure-no-auth", action="store_const", const=True,
        help="serve a non-loopback --host without API keys (anyone who can reach it may use it)",
    )
    serve.add_argument("--allowed-origin", dest="allowed_origins", action="append",
                       help="browser Origin allowed; repeatable (default: any with keys, loopback pages without)")
    serve.add_argument("--api-docs", action="store_const", const=True,
                       help="serve /docs, /redoc and /openapi.json (behind the key when keys are set)")
    serve.add_argument("--max-http-body-bytes", type=int, help="largest HTTP request body (default 1 MiB)")
    serve.add_argument("--http-body-timeout", dest="http_body_timeout_s", type=float,
                       help="seconds a client gets to send an HTTP request body (default 30)")
    serve.add_argument("--max-sessions-per-key", type=int, help="concurrent sessions per API key (0 = unlimited)")
    serve.add_argument("--sessions-per-minute", type=int, help="new sessions per API key per minute (0 = unlimited)")
    serve.add_argument("--chars-per-minute", type=int, help="characters per API key per minute (0 = unlimited)")
    serve.add_argument("--max-voices-per-key", type=int, help="cloned voices one API key may register (default 20)")
    serve.add_argument("--shared-voices-dir", help="folder of reference clips cloned at start-up into voices every key may use")
    serve.add_argument("--reference-audio-fetch", action="store_const", const=True,
                       help="accept http(s) URLs as ref_audio and fetch them (off by default)")
    serve.add_argument("--store", choices=["memory", "redis"], help="session store")
    serve.add_argument("--redis-url", help="Redis URL; given alone it selects --store redis")
    serve.add_argument("--redis-key-prefix", help="prefix of every Redis key (default voxgate:)")
    serve.add_argument("--redis-cluster", action="store_const", const=True,
                       help="--redis-url names a node of a Redis Cluster (the client finds the others)")
    serve.add_argument("--session-ttl", dest="session_ttl_s", type=float, help="seconds a disconnected session stays resumable")
    serve.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, help="seconds open utterances get on SIGTERM")
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, help="info (default), debug, warning, error,"
                       " critical, trace")
    serve.add_argument("--log-format", choices=["auto", "json", "text"],
                       help="auto (default): text on a terminal, else json (one object per line)")

    commands.add_parser("worker", help="run a synthesis worker (see `voxgate worker --help`)", add_help=False)
    return parser


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    overrides = {
        key: value
        for key, value in vars(args).items()
        if key not in ("command", "option") and value is not None
    }
    if args.option:
        overrides["backend_options"] = dict(args.option)
    if args.voice_aliases:
        overrides["voice_aliases"] = dict(args.voice_aliases)
    return GatewaySettings(**overrides)


def uvicorn_options(settings: GatewaySettings) -> dict[str, Any]:
    """How uvicorn serves the gateway (also used by the test server in tests/gateway_server.py)."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level,
        "ws_max_size": settings.max_config_bytes + WS_FRAME_MARGIN,
        "ws_per_message_deflate": False,  # audio barely compresses; deflate would only cost CPU and latency
        "http": http_protocol(settings.header_timeout_s, settings.max_request_line_bytes, settings.max_header_bytes,
                              settings.send_buffer_bytes),
        # The session's own slow-consumer deadline goes first; this one ends every other wait to write.
        "ws": abortable_ws_protocol(settings.max_unsent_bytes, settings.close_timeout_s,
                                    settings.slow_consumer_timeout_s + settings.close_timeout_s),
    }


class InsecureBinding(SystemExit):
    pass


def check_binding(settings: GatewaySettings) -> None:
    """Authentication is off by default only on loopback: refuse to serve another interface without
    API keys unless --insecure-no-auth says so."""
    if settings.api_keys or settings.insecure_no_auth or is_loopback(settings.host):
        return
    raise InsecureBinding(
        f"voxgate: refusing to serve {settings.host} without authentication: anyone who can reach it could use"
        " the speech backend. Set API keys (--api-key KEY or VOXGATE_API_KEYS='[\"KEY\"]'), or pass"
        " --insecure-no-auth (VOXGATE_INSECURE_NO_AUTH=1) if something in front of the gateway authenticates."
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound here rather than by uvicorn so that a port in use is one plain line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT sockets
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"voxgate: port {port} on {host} is already in use (another voxgate serve?);"
                             " stop that process or pick another port with --port") from None
        raise SystemExit(f"voxgate: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(settings: GatewaySettings, backend: Synthesizer | None = None) -> None:
    """Run the gateway until SIGTERM/SIGINT. Anything that keeps it from serving - a backend that cannot
    be built or fails to start, an unknown --voice, a port in use - ends the process with a non-zero exit
    and one line on stderr, so a supervisor restarts it and a person sees why. `backend`: an instance
    instead of the one `settings.backend` names (the tests' cloning backend)."""
    import uvicorn

    from .app import create_app
    from .drain import CLOSE_GRACE_S, DrainingServer
    from .logs import log_config

    check_binding(settings)
    try:
        app = create_app(settings, backend, freeze_gc_when_ready=True)
    except (SynthesisError, ValueError) as exc:  # the backend cannot even be built (options, missing torch)
        raise SystemExit(redact(f"voxgate: {exc}")) from None
    gateway = app.state.gateway
    sock = listening_socket(settings.host, settings.port)
    # timeout_graceful_shutdown: after the drain, uvicorn waits for leftover connections this long at most.
    config = uvicorn.Config(
        app,
        log_config=log_config(settings.log_level, settings.log_format),
        timeout_graceful_shutdown=CLOSE_GRACE_S,
        **uvicorn_options(settings),
    )
    server = DrainingServer(config, gateway, settings.drain_timeout_s)
    server.run(sockets=[sock])
    if server.stopped_at_once_by is not None:  # a second signal cut the drain short: say so in the status
        raise SystemExit(128 + server.stopped_at_once_by)
    if gateway.failure is not None:  # a backend's error may name a URL with a password (-o discover=...)
        raise SystemExit(redact(f"voxgate: {gateway.failure}"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        from tts_backend.remote.worker import main as worker_main  # imported only when used

        return worker_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except (ValidationError, SettingsError) as exc:
        raise SystemExit(f"voxgate: {settings_error_line(exc)}") from None
    try:
        serve(settings)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal (while the app was being built)
        raise SystemExit(128 + signal.SIGINT) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
