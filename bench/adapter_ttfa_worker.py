"""Measures time to first audio inside one framework venv (run by bench/adapter_ttfa.py).

    python adapter_ttfa_worker.py {pipecat|livekit} WS_URL RUNS TEXT VOICE

Each iteration speaks TEXT three times on persistent connections, in rotating order: with a plain
`websockets` connection speaking the protocol by hand (the raw baseline: a fresh context_id per
utterance, input.text, input.done), with voxgate_client, and through the framework adapter. Time to first audio is from the
moment the text is handed over (raw: before the send; Pipecat: before queueing the LLM frames; LiveKit:
before push_text) to the first audio byte reaching the caller. Prints "RESULTS {json}".
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import websockets


class RawClient:
    """The protocol by hand over one `websockets` connection: the floor any client library sits on."""

    async def open(self, url: str, voice: str) -> None:
        self.ws = await websockets.connect(url + "/v1/audio/speech/stream", max_size=None)
        await self.ws.send(json.dumps({"type": "session.config", "voice": voice, "stream_audio": True,
                                       "response_format": "pcm", "sample_rate": 24000}))
        assert json.loads(await self.ws.recv())["type"] == "session.started"

    async def ttfa(self, text: str) -> float:
        context_id = uuid.uuid4().hex
        start = time.perf_counter()
        await self.ws.send(json.dumps({"type": "input.text", "text": text, "context_id": context_id}))
        await self.ws.send(json.dumps({"type": "input.done", "context_id": context_id}))
        first = None
        while True:
            frame = await self.ws.recv()
            if isinstance(frame, bytes):
                if first is None:
                    first = time.perf_counter() - start
            elif json.loads(frame).get("type") == "utterance.done":
                return first

    async def close(self) -> None:
        await self.ws.close()


class ClientLibrary:
    """voxgate_client (clients/python), which both adapters are built on: one session, a context each."""

    async def open(self, url: str, voice: str) -> None:
        import voxgate_client

        self.session = await voxgate_client.connect(url, voxgate_client.SessionConfig(voice=voice, sample_rate=24000))

    async def ttfa(self, text: str) -> float:
        from voxgate_client import events

        context = self.session.context()
        start = time.perf_counter()
        await context.send_text(text)
        await context.done()
        first = None
        async for event in context.events():
            if isinstance(event, events.AudioChunk) and first is None:
                first = time.perf_counter() - start
        self.session.forget_context(context.context_id)
        return first

    async def close(self) -> None:
        await self.session.close()


class PipecatClient:
    async def open(self, url: str, voice: str) -> None:
        from pipecat.frames.frames import EndFrame, TTSAudioRawFrame, TTSStoppedFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.processors.frame_processor import FrameProcessor
        from pipecat.workers.runner import WorkerRunner

        from voxgate_pipecat import VoxgateTTSService

        client = self

        class FirstAudio(FrameProcessor):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if isinstance(frame, TTSAudioRawFrame) and client.first is None:
                    client.first = time.perf_counter()
                if isinstance(frame, TTSStoppedFrame):
                    client.stopped.set()
                await self.push_frame(frame, direction)

        self.EndFrame = EndFrame
        self.first: float | None = None
        self.stopped = asyncio.Event()
        self.tts = VoxgateTTSService(url=url, settings=VoxgateTTSService.Settings(voice=voice))
        self.worker = PipelineWorker(
            Pipeline([self.tts, FirstAudio()]),
            params=PipelineParams(audio_out_sample_rate=24000),
            idle_timeout_secs=None,
            enable_rtvi=False,
        )
        started = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker, frame):
            started.set()

        self.runner = WorkerRunner(handle_sigint=False)
        await self.runner.add_workers(self.worker)
        self.run_task = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(started.wait(), 30)
        while self.tts.session is None:
            await asyncio.sleep(0.01)

    async def ttfa(self, text: str) -> float:
        from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame

        self.first = None
        self.stopped.clear()
        start = time.perf_counter()
        await self.worker.queue_frames([LLMFullResponseStartFrame(), LLMTextFrame(text), LLMFullResponseEndFrame()])
        await asyncio.wait_for(self.stopped.wait(), 30)
        return self.first - start

    async def close(self) -> None:
        await self.worker.queue_frame(self.EndFrame())
        await asyncio.wait_for(self.run_task, 30)


class LiveKitClient:
    async def open(self, url: str, voice: str) -> None:
        from voxgate_livekit import TTS

        self.tts = TTS(url=url, voice=voice)
        warm = self.tts.stream()  # opens the shared session, as prewarm() does
        warm.push_text("Warm up.")
        warm.end_input()
        async for _ in warm:
            pass
        await warm.aclose()

    async def ttfa(self, text: str) -> float:
        first = None
        stream = self.tts.stream()  # the agent opens the stream when the reply starts
        start = time.perf_counter()
        stream.push_text(text)
        stream.end_input()
        async for _ in stream:
            if first is None:
                first = time.perf_counter() - start
        await stream.aclose()
        return first

    async def close(self) -> None:
        await self.tts.aclose()


async def main(framework: str, url: str, runs: int, text: str, voice: str) -> dict:
    clients = {
        "raw_websocket": RawClient(),
        "voxgate_client": ClientLibrary(),
        framework: PipecatClient() if framework == "pipecat" else LiveKitClient(),
    }
    for client in clients.values():
        await client.open(url, voice)
    times: dict[str, list[float]] = {name: [] for name in clients}
    order = list(clients.items())
    try:
        for _ in range(2):  # warm-up, not recorded
            for _, client in order:
                await client.ttfa(text)
        for i in range(runs):
            for name, client in order[i % 3:] + order[: i % 3]:  # rotate who goes first
                times[name].append(await client.ttfa(text))
    finally:
        for client in clients.values():
            await client.close()
    return times


if __name__ == "__main__":
    framework, url, runs, text, voice = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    print("RESULTS " + json.dumps(asyncio.run(main(framework, url, runs, text, voice))))
