"""Sentences from many sessions -> one aligner batch at a time, on a thread of its own.

`AlignmentBatcher.align(request)` is awaited by a backend once a sentence's audio is complete; the thread takes
every request queued at that moment (up to `max_batch`) and aligns them in one forward pass, so sentences that
finish together share one pass and none waits for a batch to fill. The event loop never runs the model.

Its thread and the speech engine's share the interpreter: on a GPU the aligner should be captured
(ForcedAligner.capture), so that a batch is a few graph replays, launched with the interpreter released, rather
than two thousand ops that each wait for it. process.py runs the same batching in a process of its own instead.

On a CUDA device the aligner runs on a CUDA stream of its own, so its kernels queue beside the speech engine's
instead of behind them on the default stream; the engine's first audio of a new sentence is never ordered after
an alignment.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .model import AlignRequest, ForcedAligner, WordTime

log = logging.getLogger(__name__)


@dataclass
class _Job:
    request: AlignRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def post(waiter, result=None, error: BaseException | None = None) -> None:
    """From another thread: settle `waiter.future` (an asyncio future) on `waiter.loop` with a result or error."""
    try:
        waiter.loop.call_soon_threadsafe(_settle, waiter.future, result, error)
    except RuntimeError:  # its event loop has closed: nobody is waiting any more
        pass


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the awaiting task was cancelled (its session went away)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def align_each(align, requests: list[AlignRequest]) -> list[list[WordTime] | Exception]:
    """`align(requests)`'s results, each sentence's own error in its place: one sentence that fails must not fail
    the others of its batch, so a failed batch is aligned again one sentence at a time to find it."""
    try:
        return align(requests)
    except Exception as exc:
        if len(requests) == 1:
            log.exception("alignment failed")
            return [exc]
    results: list[list[WordTime] | Exception] = []
    for request in requests:
        try:
            results.append(align([request])[0])
        except Exception as single:
            log.exception("alignment failed")
            results.append(single)
    return results


class AlignmentBatcher:
    def __init__(self, aligner: ForcedAligner, max_batch: int = 16, gather_s: float = 0.0):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not gather_s >= 0:
            raise ValueError("gather_s must be a number of seconds >= 0")
        self.aligner = aligner
        self.max_batch = max_batch
        # How long a pass waits after its first sentence for more (up to max_batch): the captured pass costs
        # nearly as much for one sentence as for four (H100: 8.65 against 12.3 ms), and each pass is device time
        # the speech engine shares. Words come that much later; 0: a pass takes what is queued and goes.
        self.gather_s = gather_s
        self.batches = 0  # forward passes run (for tests and metrics)
        self.sentences = 0
        # Wall time of the forward passes on this thread, results on the host included: what alignment costs
        # beside the speech engine (its share of the device when both run, with the backend's metrics).
        self.seconds = 0.0
        self.restarts = 0  # as process.AlignerProcess's: a thread is never started again
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stream = torch.cuda.Stream(aligner.device) if aligner.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="voxgate-aligner", daemon=True)
        self._thread.start()

    async def align(self, request: AlignRequest) -> list[WordTime]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Job(request, future, loop))
        return await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            deadline = time.monotonic() + self.gather_s
            while len(jobs) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    nxt = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                jobs.append(nxt)
            jobs = [j for j in jobs if not j.future.done()]
            if not jobs:
                continue
            started = time.perf_counter()
            results = align_each(self._align, [j.request for j in jobs])
            self.seconds += time.perf_counter() - started
            self.batches += 1
            self.sentences += len(jobs)
            for j, result in zip(jobs, results):
                if isinstance(result, Exception):
                    post(j, error=result)
                else:
                    post(j, result)

    def _align(self, requests: list[AlignRequest]) -> list[list[WordTime]]:
        if self._stream is None:
            return self.aligner.align(requests)
        with torch.cuda.stream(self._stream):
            return self.aligner.align(requests)
