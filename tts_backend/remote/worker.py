"""`voxgate worker`: a synthesis backend in its own process, served over a local Unix socket.

One GPU host can run one worker (the engine, the model, the CUDA graphs) and several gateway replicas
that reach it with `--backend remote --socket PATH`. The protocol is in framing.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import gc
import logging
import os
import signal
from typing import Any

from . import framing
from ..base import (
    BackendMetric,
    ReferenceAudio,
    SynthesisError,
    Synthesizer,
)
from ..registry import create_backend

log = logging.getLogger(__name__)


def error_code(exc: BaseException) -> str:
    for kind, code in framing.ERROR_CODES.items():
        if isinstance(exc, kind):
            return code
    if isinstance(exc, SynthesisError):
        return "synthesis_failed"
    return "internal"


class WorkerServer:
    def __init__(self, backend: Synthesizer, socket_path: str) -> None:
        self.backend = backend
        self.socket_path = socket_path
        self._server: asyncio.AbstractServer | None = None
        self.streams_in_flight = 0

    def info(self) -> dict:
        return {
            "op": "info",
            "name": self.backend.name,
            "sample_rate": self.backend.sample_rate,
            "ready": self.backend.ready,
            "load": self.backend.load(),
            "streams": self.streams_in_flight,
            "default_voice": self.backend.default_voice,
            "voices": [dataclasses.asdict(v) for v in self.backend.voices()],
            "honours": sorted(self.backend.honours),
            "speaks_only_clones": self.backend.speaks_only_clones,
        }

    async def metrics(self) -> dict:
        """The backend's metrics and the worker's own, for the gateway's /metrics (RemoteSynthesizer)."""
        streams = BackendMetric("worker_streams", "gauge", "Streams the worker is serving now",
                                samples=(((), float(self.streams_in_flight)),))
        metrics = [streams, *await self.backend.metrics()]
        return {"op": "metrics", "metrics": [m.to_json() for m in metrics]}

    async def clone(self, message: dict) -> dict:
        reference = ReferenceAudio(framing.decode_base64(message.get("samples"), "samples"),
                                   message.get("ref_text"))
        if reference.ref_text is not None and not isinstance(reference.ref_text, str):
            raise framing.ProtocolError("ref_text must be a string or null")
        try:
            prompt = await self.backend.clone_voice(reference, bool(message.get("x_vector_only", False)))
        except SynthesisError as exc:
            return {"op": "error", "code": error_code(exc), "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged here
            log.exception("cloning failed")
            return {"op": "error", "code": "internal", "message": str(exc)}
        return {"op": "clone", "prompt": base64.b64encode(prompt).decode()}

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._server = await asyncio.start_unix_server(self._handle, path=self.socket_path)
        os.chmod(self.socket_path, 0o660)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            frame = await framing.read_frame(reader)
            if frame is None:
                return
            kind, payload = frame
            if kind != framing.JSON:
                raise framing.ProtocolError("expected a JSON frame first")
            message = framing.decode_json(payload)
            if message["op"] == "info":
                writer.write(framing.encode_json(self.info()))
                await writer.drain()
            elif message["op"] == "metrics":
                writer.write(framing.encode_json(await self.metrics()))
                await writer.drain()
            elif message["op"] == "clone":
                writer.write(framing.encode_json(await self.clone(message)))
                await writer.drain()
            elif message["op"] == "synthesize":
                await self._synthesize(message.get("request") or {}, reader, writer)
            else:
                raise framing.ProtocolError(f"unknown op {message['op']!r}")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away; its stream was cancelled with it
        except framing.ProtocolError as exc:
            with contextlib.suppress(ConnectionError):
                writer.write(framing.encode_json({"op": "error", "code": "bad_request", "message": str(exc)}))
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _synthesize(self, data: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        produce = asyncio.create_task(self._stream(data, writer))
        # Any frame or end-of-file from the client while we stream means "stop".
        hangup = asyncio.create_task(reader.read(1))
        try:
            done, _ = await asyncio.wait({produce, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if produce not in done:
                produce.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await produce
                return
            await produce
        finally:
            hangup.cancel()

    async def _stream(self, data: dict, writer: asyncio.StreamWriter) -> None:
        self.streams_in_flight += 1
        try:
            await self._stream_inner(data, writer)
        finally:
            self.streams_in_flight -= 1

    async def _stream_inner(self, data: dict, writer: asyncio.StreamWriter) -> None:
        try:
            request = framing.request_from_json(data)
            stream = self.backend.synthesize(request)
            try:
                async for chunk in stream:
                    if chunk.words:  # before the chunk's audio, as the backend gave them
                        writer.write(framing.encode_json({"op": "words", "words": [w.to_json() for w in chunk.words]}))
                    if chunk.pcm:
                        writer.write(framing.encode(framing.AUDIO, chunk.pcm))
                    await writer.drain()  # a slow reader slows the stream: back-pressure reaches the engine
            finally:
                await stream.aclose()
            writer.write(framing.encode_json({"op": "done"}))
        except (SynthesisError, TypeError, ValueError) as exc:
            writer.write(framing.encode_json({"op": "error", "code": error_code(exc), "message": str(exc)}))
        except ConnectionError:
            return
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged here
            log.exception("synthesis failed")
            writer.write(framing.encode_json({"op": "error", "code": "internal", "message": str(exc)}))
        await writer.drain()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="voxgate worker", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", default=os.environ.get("VOXGATE_WORKER_SOCKET", "/tmp/voxgate-worker.sock"),
                        help="Unix socket path to listen on")
    parser.add_argument("--backend", default=os.environ.get("VOXGATE_BACKEND", "qwen3"),
                        help="backend to serve (qwen3, synthetic, piper)")
    parser.add_argument("--model", default=os.environ.get("VOXGATE_MODEL"), help="checkpoint folder (qwen3)")
    parser.add_argument("--device", default=os.environ.get("VOXGATE_DEVICE"), help="torch device (qwen3)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra backend option (repeatable); values are parsed as JSON when they can be")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    import json

    options: dict[str, Any] = {}
    if args.model:
        options["model"] = args.model
    if args.device:
        options["device"] = args.device
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--option needs KEY=VALUE, got {item!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            options[key.replace("-", "_")] = value
    return options


async def serve(args: argparse.Namespace) -> None:
    backend = create_backend(args.backend, **backend_options(args))
    await backend.start()
    # As `voxgate serve` does once its backend is up: keep the cyclic collector's full passes off the
    # model's and torch's objects, whose scans would pause the engine thread for hundreds of ms.
    gc.collect()
    gc.freeze()
    server = WorkerServer(backend, args.socket)
    await server.start()
    log.info("voxgate worker: %s backend ready on %s", backend.name, args.socket)
    print(f"voxgate worker ready: backend={backend.name} socket={args.socket}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.close()
        await backend.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
