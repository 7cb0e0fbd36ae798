"""The aligner in a process of its own: batching as batcher.py's, without sharing the engine's interpreter.

A thread beside the speech engine's takes the interpreter from it at every op it dispatches and waits for it as
often (issue 32: at 20 RPS the aligner thread spent 98 % of its time on 63 ms per sentence). Here the model,
its CUDA context and its graphs live in a spawned process; the serving process only hands over each
sentence's audio and text and reads back its words.

Hand-over: `align` puts the sentence on an in-process queue, from which a sender thread pickles it into the
process's pipe, so the caller's event loop only appends to a queue. (Not a multiprocessing.Queue: its feeder
thread would wait forever on the pipe of a process that died, since the queue keeps the pipe's reading end.) The process takes everything queued when it
is free (up to `max_batch`), aligns it as one batch, and sends back the batch's words in one message, which a
reader thread here hands to each awaiting task. A sentence whose task gives up (the gateway's bound on late
words) is withdrawn: the process drops it if it has not started it.

Bounded: at most `max_pending` sentences are handed over and not answered; beyond that `align` refuses at once
(AlignerUnavailable) instead of queueing words that would come too late to be used.

A crash costs words, never audio: the sentences in flight get AlignerUnavailable, and so does every sentence
until a fresh process is ready (started again after `restart_after_s`, doubling up to a minute while it keeps
failing). The backend turns that into late words (qwen3_backend.py), which the gateway already ends without.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

from .batcher import post
from .model import AlignRequest, WordTime

log = logging.getLogger(__name__)

_MAX_RESTART_DELAY_S = 60.0


class AlignerUnavailable(RuntimeError):
    """The aligner process cannot take this sentence: it is not running, or too much is queued for it."""


class AlignmentFailed(RuntimeError):
    """The aligner process could not align this sentence (its message says why)."""


@dataclass
class _Waiter:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Child:
    process: mp.process.BaseProcess
    requests: mp.connection.Connection  # to the process; written by `sender` only
    results: mp.connection.Connection  # from the process; read by the reader thread only
    outbox: queue.SimpleQueue  # what `sender` writes, in order; None last
    sender: threading.Thread

    def put(self, message) -> None:
        self.outbox.put(message)


def _send(requests: mp.connection.Connection, outbox: queue.SimpleQueue) -> None:
    while True:
        message = outbox.get()
        try:
            requests.send(message)
        except (OSError, ValueError):  # the process is gone, or its pipe closed: the rest is dropped
            return
        if message is None:
            return


class AlignerProcess:
    """The aligner of checkpoint `folder` on `device` (dtype a torch dtype's name), in a spawned process.

    Same interface as batcher.AlignmentBatcher: `await align(request)`, `close()`, and the counters `batches`,
    `sentences`, `seconds` (the process's forward passes, as it reports them), plus `restarts`."""

    def __init__(self, folder: str, device: str = "cpu", dtype: str = "bfloat16", max_batch: int = 16,
                 max_pending: int = 256, torch_threads: int = 2, restart_after_s: float = 1.0,
                 gather_s: float = 0.0) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not gather_s >= 0:
            raise ValueError("gather_s must be a number of seconds >= 0")
        # gather_s: as batcher.AlignmentBatcher's, in the process: a pass waits that long after its first
        # sentence for more.
        self.options = dict(folder=str(folder), device=str(device), dtype=dtype, max_batch=max_batch,
                            torch_threads=torch_threads, gather_s=gather_s)
        self.max_pending = max_pending
        self.restart_after_s = restart_after_s
        self.batches = 0
        self.sentences = 0
        self.seconds = 0.0
        self.restarts = 0
        self._context = mp.get_context("spawn")  # never fork a process that holds CUDA and threads
        self._lock = threading.Lock()
        self._waiters: dict[int, _Waiter] = {}
        self._next_id = 0
        self._closed = threading.Event()
        self._child: _Child | None = None  # set while a process is ready for sentences
        self._starting = self._spawn()
        self._reader: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    def _spawn(self) -> _Child:
        requests_end, requests = self._context.Pipe(duplex=False)
        results, results_end = self._context.Pipe(duplex=False)
        process = self._context.Process(target=serve, args=(self.options, requests_end, results_end),
                                        name="voxgate-aligner", daemon=True)
        process.start()
        # Only the process holds these ends now: a read here sees EOF, a write a broken pipe, once it is gone.
        requests_end.close()
        results_end.close()
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        sender = threading.Thread(target=_send, args=(requests, outbox), name="voxgate-aligner-sender",
                                  daemon=True)
        sender.start()
        return _Child(process, requests, results, outbox, sender)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until the first process has loaded (and on a GPU captured) the aligner; raise RuntimeError with
        its error if it could not. Then the reader thread starts taking its answers."""
        child, self._starting = self._starting, None
        self._await_ready(child, timeout_s)
        with self._lock:
            self._child = child
        self._reader = threading.Thread(target=self._read, name="voxgate-aligner-reader", daemon=True)
        self._reader.start()

    def _await_ready(self, child: _Child, timeout_s: float) -> None:
        try:
            if not child.results.poll(timeout_s):
                raise RuntimeError(f"the aligner process did not start within {timeout_s:g} s")
            message = child.results.recv()
        except (EOFError, OSError):
            child.process.join(5)
            message = ("failed", f"the aligner process exited with code {child.process.exitcode}")
        except BaseException:
            self._stop(child)
            raise
        if message[0] != "ready":
            self._stop(child)
            raise RuntimeError(f"the aligner process failed to start: {message[1]}")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            child, self._child = self._child, None
        children = [c for c in (child, self._starting) if c is not None]
        for c in children:
            self._stop(c, close_pipes=False)
        if self._reader is not None:  # it has seen the process end, and the pipes may close under it no more
            self._reader.join(10)
        for c in children:
            c.requests.close()
            c.results.close()
        self._fail_waiters("the aligner is closed")

    def _stop(self, child: _Child, close_pipes: bool = True) -> None:
        child.put(None)
        child.process.join(10)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5)
        child.sender.join(5)  # a write to the dead process's pipe has failed by now
        if close_pipes:
            child.requests.close()
            child.results.close()

    @property
    def alive(self) -> bool:
        """A process is ready for sentences now."""
        child = self._child
        return child is not None and child.process.is_alive()

    @property
    def pending(self) -> int:
        """Sentences handed over and not answered yet (at most max_pending)."""
        return len(self._waiters)

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.process.pid if child is not None else None

    # ---- requests ------------------------------------------------------------------------------------
    async def align(self, request: AlignRequest) -> list[WordTime]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            child = self._child
            if child is None:
                raise AlignerUnavailable("the aligner process is not running")
            if len(self._waiters) >= self.max_pending:
                raise AlignerUnavailable(f"{self.max_pending} sentences are already waiting for the aligner")
            job, self._next_id = self._next_id, self._next_id + 1
            self._waiters[job] = _Waiter(future, loop)
        child.put(("align", job, request.audio, request.sample_rate, request.text, request.language))
        try:
            return await future
        finally:
            if not future.done() or future.cancelled():
                with self._lock:
                    withdrawn = self._waiters.pop(job, None) is not None
                if withdrawn:
                    child.put(("cancel", job))

    def _read(self) -> None:
        """The reader thread: answers to their waiters; a process that died is replaced."""
        child = self._child
        while child is not None:
            try:
                ready = wait([child.results, child.process.sentinel])
            except (OSError, ValueError):  # closed under us: close() is under way
                return
            if child.results in ready:
                try:
                    self._answer(child.results.recv())
                    continue
                except (EOFError, OSError):
                    pass
            if self._closed.is_set():
                return
            child.process.join(5)
            log.error("the aligner process exited (code %s): word timings are late until a new one is ready",
                      child.process.exitcode)
            with self._lock:
                self._child = None
            self._fail_waiters("the aligner process exited")
            self._stop(child)
            child, delay = None, self.restart_after_s
            while child is None and not self._closed.is_set():
                child = self._restart(delay)
                delay = min(2 * delay, _MAX_RESTART_DELAY_S)

    def _restart(self, delay_s: float) -> _Child | None:
        if self._closed.wait(delay_s):
            return None
        try:
            child = self._spawn()
            self._await_ready(child, 600.0)
        except Exception:
            log.exception("the aligner process failed to start again")
            return None
        with self._lock:
            if self._closed.is_set():
                self._stop(child)
                return None
            self.restarts += 1
            self._child = child
        log.warning("a new aligner process is ready (pid %s)", child.process.pid)
        return child

    def _answer(self, message: tuple) -> None:
        kind, stats, answers = message
        assert kind == "batch", kind
        self.batches, self.sentences, self.seconds = stats  # before the waiters wake, so they see this batch
        for job, words, error in answers:
            with self._lock:
                waiter = self._waiters.pop(job, None)
            if waiter is not None:
                post(waiter, words, None if error is None else AlignmentFailed(error))

    def _fail_waiters(self, why: str) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, {}
        for waiter in waiters.values():
            post(waiter, error=AlignerUnavailable(why))


# ---- the aligner process -------------------------------------------------------------------------------
def serve(options: dict, requests, results) -> None:
    """The process's main: load, say ready, then align what comes until None (or the parent is gone).
    requests: the reading end of the parent's pipe (poll, recv); results: the writing end of ours (send)."""
    try:
        import torch

        from .batcher import align_each
        from .loader import load_aligner

        torch.set_num_threads(options["torch_threads"])
        aligner = load_aligner(options["folder"], options["device"], getattr(torch, options["dtype"]))
        aligner.capture(options["max_batch"])  # CUDA graphs on a GPU; nothing on the CPU
    except BaseException:
        results.send(("failed", traceback.format_exc(limit=-3)))
        return
    results.send(("ready", None))
    parent = mp.parent_process()
    backlog: dict[int, AlignRequest] = {}
    batches = sentences = 0
    seconds = 0.0

    def take(message) -> bool:
        if message is None:
            return False
        if message[0] == "align":
            _, job, audio, rate, text, language = message
            backlog[job] = AlignRequest(audio, rate, text, language)
        else:  # ("cancel", job): its waiter gave up
            backlog.pop(message[1], None)
        return True

    while True:
        try:
            if not backlog:
                if not requests.poll(1.0):
                    if parent is not None and not parent.is_alive():
                        return
                    continue
                if not take(requests.recv()):
                    return
            while requests.poll():  # everything queued now: more sentences for this batch, and withdrawals
                if not take(requests.recv()):
                    return
            deadline = time.monotonic() + options["gather_s"]
            while len(backlog) < options["max_batch"] and requests.poll(max(0.0, deadline - time.monotonic())):
                if not take(requests.recv()):
                    return
        except (EOFError, OSError):  # the parent is gone
            return
        jobs = list(backlog)[: options["max_batch"]]
        if not jobs:
            continue
        batch = [backlog.pop(job) for job in jobs]
        started = time.perf_counter()
        words = align_each(aligner.align, batch)
        seconds += time.perf_counter() - started
        batches += 1
        sentences += len(batch)
        answers = [(job, None, str(w) or type(w).__name__) if isinstance(w, Exception) else (job, w, None)
                   for job, w in zip(jobs, words)]
        try:
            results.send(("batch", (batches, sentences, seconds), answers))
        except (BrokenPipeError, OSError):  # the parent is gone
            return
