"""Issue 30, item 3: peers that never authenticate must not keep gateways out of a worker. Four threads open
idle TCP connections to a real worker as fast as it accepts them (from the gateway's own address: loopback)
while a real gateway process serves sessions through it: every session must be spoken, and the gateway's
/ready must stay 200 throughout."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import selectors
import socket
import threading

import httpx

from tests.test_worker_relay import gateway_process
from tests.test_worker_trust import assert_spoken, speak, token_file  # noqa: F401 (fixture)
from tests.worker_fixtures import synthetic_worker_args, workers
from tts_backend.remote.connection import WorkerAddress
from tts_backend.remote.pending import PendingHandshakes

THREADS = 4
IN_FLIGHT = 32  # connects each thread has under way at once (non-blocking): the worker's accept queue stays busy
HELD = 200  # idle connections each thread keeps open at once (the oldest closed for a new one)


class IdleFlood:
    """THREADS threads, each opening TCP connections to `target` as fast as the worker accepts them, IN_FLIGHT
    at a time, and sending nothing on them."""

    def __init__(self, target: WorkerAddress) -> None:
        self.target = (target.host, target.port)
        self.opened = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(THREADS)]

    def _connect(self, selector: selectors.BaseSelector) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(self.target) not in (0, errno.EINPROGRESS):
            sock.close()
            return
        selector.register(sock, selectors.EVENT_WRITE)

    def _run(self) -> None:
        held: collections.deque[socket.socket] = collections.deque()
        with selectors.DefaultSelector() as selector:
            while not self._stop.is_set():
                while len(selector.get_map()) < IN_FLIGHT:
                    self._connect(selector)
                for key, _ in selector.select(timeout=0.1):
                    selector.unregister(key.fileobj)
                    if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        held.append(key.fileobj)
                        self.opened += 1
                    else:
                        key.fileobj.close()
                while len(held) > HELD:
                    held.popleft().close()
            for key in list(selector.get_map().values()):
                key.fileobj.close()
        for sock in held:
            sock.close()

    def __enter__(self) -> "IdleFlood":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)


async def watch_ready(url: str, stop: asyncio.Event, answers: list[int]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.TransportError):
                answers.append((await client.get(url + "/ready")).status_code)
            await asyncio.sleep(0.05)


async def attempt(gateway, text: str) -> list:
    """`speak`'s answer, or a refusal or timeout as an error message."""
    try:
        return await speak(gateway, text, timeout=60)
    except (AssertionError, asyncio.TimeoutError) as exc:
        return [{"type": "error", "message": str(exc)[:200]}]


async def test_idle_connections_from_the_gateways_address_do_not_keep_it_out(token_file):
    """Before: 3 (another run: 30) of 36 sessions were spoken and /ready said 503 in 3 of 5 polls (1 of 15): the
    cap of 64 connections mid-handshake dropped the gateway's own handshakes, one failed info query marked the
    worker down, and the accept queue of 100 dropped the gateway's connects for a second. After: 36 of 36,
    /ready 200 throughout, with seven times the idle connections opened."""
    with workers(synthetic_worker_args("--token-file", token_file, speed=0)) as (worker,):
        async with gateway_process("-o", f"workers={worker.address}") as gateway:
            ready: list[int] = []
            stop = asyncio.Event()
            spoken, failed = 0, []
            with IdleFlood(WorkerAddress.parse(worker.address)) as flood:
                while flood.opened < 500:  # the flood is on before the first session
                    await asyncio.sleep(0.05)
                watcher = asyncio.create_task(watch_ready(gateway.url, stop, ready))
                for round_ in range(12):
                    texts = [f"Round {round_} session {n} gets through." for n in range(3)]
                    answers = await asyncio.gather(*(attempt(gateway, text) for text in texts))
                    for text, answer in zip(texts, answers):
                        if answer[-1]["type"] == "session.done":
                            assert_spoken([text], [answer])
                            spoken += 1
                        else:
                            failed.append(answer[-1])
                stop.set()
                await watcher
                opened = flood.opened
    not_ready = sum(status != 200 for status in ready)
    print(f"{spoken} of 36 sessions spoken, /ready not 200 in {not_ready} of {len(ready)} polls, "
          f"{opened} idle connections opened")
    assert spoken == 36, failed[:3]
    assert ready and not_ready == 0


def test_the_connection_dropped_is_the_oldest_silent_one_of_the_fullest_bound():
    """pending.py's choice: within a source's bound, then within the whole bound, the oldest connection that
    has sent no hello goes first, one that has only when none is left, and never the newcomer while another
    can go."""
    pending = PendingHandshakes(cap=6, per_source=3)
    assert pending.add("gateway", "10.0.0.1") == []
    pending.greet("gateway")  # its hello came
    assert pending.add("idle-1", "10.0.0.1") == [] and pending.add("idle-2", "10.0.0.1") == []
    assert pending.add("idle-3", "10.0.0.1") == ["idle-1"]  # the source's bound: its oldest silent one
    assert pending.add("idle-4", "10.0.0.1") == ["idle-2"]
    for n in range(3):
        assert pending.add(f"other-{n}", "10.0.0.2") == []
    assert pending.add("other-3", "10.0.0.2") == ["other-0"]  # the source's bound again
    assert pending.add("third", "10.0.0.3") == ["idle-3"]  # the whole bound: the oldest silent anywhere
    pending.greet("idle-4")
    for name in ("other-1", "other-2", "other-3", "third"):
        pending.greet(name)
    assert pending.add("late", "10.0.0.4") == ["gateway"]  # none silent but the newcomer: the oldest greeted
    pending.remove("late")
    pending.remove("late")  # again: nothing happens
    assert len(pending) == 5
