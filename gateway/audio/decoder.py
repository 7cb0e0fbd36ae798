"""Reference clips decoded in separate, bounded processes: a decoder crash costs one request, not the replica.

FFmpeg parsing a stranger's file is the gateway's riskiest code (one 144-byte FLAC of 8 channels was
enough to SIGSEGV it, in PyAV). So `ReferenceDecoder` keeps a few decoder processes, each started fresh
(`python -m gateway.audio.decoder`, not a fork of the gateway and its memory), and sends each clip to
one of them over its stdin/stdout pipes. Each process is bounded:
- memory: RLIMIT_AS, its address space after start-up plus `memory_bytes` (a decode bomb meets
  MemoryError or dies, alone);
- CPU: RLIMIT_CPU, raised before each clip to what it has used plus `cpu_s` (SIGXCPU ends a clip that
  spins);
- time: the gateway kills a process whose answer takes longer than `wall_s`;
- no core files, no files written, none of the gateway's environment (its secrets) but what starting
  Python needs; it ends with the gateway (its stdin closes; on Linux also PR_SET_PDEATHSIG);
- reach: none of the gateway's descriptors but its pipes and stderr, and where Linux has them,
  no_new_privs and a Landlock sandbox (gateway/audio/sandbox.py): it reads Python's files and nothing else.
A process that crashed, overran or was cancelled mid-clip is killed and replaced by a fresh one at the next
clip; the others keep serving. A clip waits at most `queue_s` for a free process (DecoderBusy: the
gateway answers `overloaded`), so a flood of clips is refused rather than queued without end. The gateway waits on the pipes from its event loop: nothing blocks it.
A process's answer is not trusted beyond its size: at most the samples `max_s` can hold.

Wire (both ways little-endian): request `<ddII` min_s, max_s, output rate, clip length, then the clip;
answer `<BI` status (0 samples, 1 refusal), payload length, then float32 samples or a UTF-8 message.

bench/reference_decode_cost.py measures what a clip costs this way against decoding in the process.
Knows nothing of the rest of the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import struct
import sys

import numpy as np

log = logging.getLogger("voxgate.reference_decoder")

PROCESSES = 2  # clips decoded at once per replica (CPU cores)
WALL_S = 10.0  # one clip's decode, from the request sent to the answer read
QUEUE_S = 20.0  # a clip waits this long for a free process, then is refused as overload
CPU_S = 5.0  # CPU seconds one clip may take in its process
MEMORY_BYTES = 1 << 30  # address space a process may add to what it had once started
START_TIMEOUT_S = 30.0  # a fresh process's start-up (Python, PyAV, numpy) on a loaded machine
CLIPS_PER_PROCESS = 256  # then a fresh process: whatever FFmpeg leaked or fragmented goes with the old one
_REQUEST = struct.Struct("<ddII")
_ANSWER = struct.Struct("<BI")
_READY = b"R"
_OK, _REFUSED = 0, 1
MAX_MESSAGE_BYTES = 1024


class DecoderFailed(Exception):
    """The clip was not decoded: refused by the decoder (`refusal` is its message for the client), or the
    process crashed, overran a limit or answered nonsense (`refusal` is None)."""

    def __init__(self, reason: str, refusal: str | None = None) -> None:
        super().__init__(reason)
        self.refusal = refusal


class DecoderBusy(Exception):
    """Every decoder process stayed busy for `queue_s`: the replica is overloaded with clips."""


class _Process:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.clips = 0

    async def decode(self, data: bytes, min_s: float, max_s: float, rate: int) -> np.ndarray:
        stdin, stdout = self.process.stdin, self.process.stdout
        stdin.write(_REQUEST.pack(min_s, max_s, rate, len(data)))
        stdin.write(data)
        await stdin.drain()
        status, length = _ANSWER.unpack(await stdout.readexactly(_ANSWER.size))
        if status == _OK and length % 4 == 0 and length <= (max_s + 1) * rate * 4:
            return np.frombuffer(await stdout.readexactly(length), "<f4")
        if status == _REFUSED and length <= MAX_MESSAGE_BYTES:
            raise DecoderFailed("refused", (await stdout.readexactly(length)).decode("utf-8", "replace"))
        raise DecoderFailed(f"answered status {status} with {length} bytes")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def ended(self) -> str:
        """How the process ended, once it has (for the log)."""
        code = await self.process.wait()
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"


class ReferenceDecoder:
    """Up to `processes` decoder processes, started when first needed and reused (see the module doc).
    `command` runs one (tests plant faults with their own)."""

    def __init__(self, processes: int = PROCESSES, *, wall_s: float = WALL_S, cpu_s: float = CPU_S,
                 memory_bytes: int = MEMORY_BYTES, queue_s: float = QUEUE_S, command: list[str] | None = None) -> None:
        self.wall_s = wall_s
        self.queue_s = queue_s
        self.cpu_s = cpu_s
        self.memory_bytes = memory_bytes
        self.command = command or [sys.executable, "-m", "gateway.audio.decoder"]
        self._slots = asyncio.Semaphore(processes)
        self._idle: list[_Process] = []
        self.started = 0  # processes started, for the tests and the bench
        self._stopped = False

    async def decode(self, data: bytes, min_s: float, max_s: float, rate: int) -> np.ndarray:
        """float32 mono samples at `rate`. Raises DecoderFailed, or DecoderBusy when no process is free
        within `queue_s`."""
        await self._acquire()
        try:
            return await self._decode(data, min_s, max_s, rate)
        finally:
            self._slots.release()

    async def _decode(self, data: bytes, min_s: float, max_s: float, rate: int) -> np.ndarray:
        worker = self._idle.pop() if self._idle else await self._start()
        try:
            samples = await asyncio.wait_for(worker.decode(data, min_s, max_s, rate), self.wall_s)
        except DecoderFailed as failed:
            if failed.refusal is None:
                await self._discard(worker, str(failed))
            else:
                self._keep(worker)
            raise
        except asyncio.TimeoutError:
            await self._discard(worker, f"no answer within {self.wall_s:g} s")
            raise DecoderFailed("deadline") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            await self._discard(worker, "its pipe closed")
            raise DecoderFailed("died") from None
        except BaseException:  # cancelled mid-clip: its answer would be read by the next clip
            worker.kill()
            raise
        self._keep(worker)
        return samples

    async def _acquire(self) -> None:
        """One of the slots within queue_s, else DecoderBusy. (Not wait_for: on Python 3.10-3.11 it can
        time out after the acquire succeeded, and the slot would be lost for good.)"""
        acquire = asyncio.ensure_future(self._slots.acquire())
        try:
            done, _ = await asyncio.wait({acquire}, timeout=self.queue_s)
        except BaseException:  # cancelled while waiting
            self._abandon(acquire)
            raise
        if not done:
            self._abandon(acquire)
            raise DecoderBusy(f"no decoder process was free within {self.queue_s:g} s")

    def _abandon(self, acquire: asyncio.Future) -> None:
        """Give up a pending acquire; a slot it got meanwhile goes back."""
        if not acquire.done():
            acquire.cancel()
        elif not acquire.cancelled():
            self._slots.release()

    def _keep(self, worker: _Process) -> None:
        worker.clips += 1
        if worker.clips >= CLIPS_PER_PROCESS or self._stopped:
            worker.kill()
        else:
            self._idle.append(worker)

    async def _discard(self, worker: _Process, why: str) -> None:
        worker.kill()
        ended = await worker.ended()
        log.warning("a reference audio decoder process failed (%s; %s); the clip is refused and a fresh"
                    " process decodes the next", why, ended)

    async def _start(self) -> _Process:
        process = await asyncio.create_subprocess_exec(
            *self.command, str(self.memory_bytes), str(self.cpu_s), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=_child_env(),
        )
        worker = _Process(process)
        self.started += 1
        try:
            ready = await asyncio.wait_for(process.stdout.readexactly(1), START_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            worker.kill()
            raise DecoderFailed(f"a decoder process did not start ({await worker.ended()})") from None
        except BaseException:
            worker.kill()
            raise
        if ready != _READY:
            worker.kill()
            raise DecoderFailed("a decoder process started wrongly")
        return worker

    async def stop(self) -> None:
        self._stopped = True
        idle, self._idle = self._idle, []
        for worker in idle:
            worker.process.stdin.close()  # it ends at the closed pipe
        for worker in idle:
            try:
                await asyncio.wait_for(worker.process.wait(), 5.0)
            except asyncio.TimeoutError:
                worker.kill()


# One BLAS and one FFmpeg thread, few malloc arenas: the address-space limit then measures the clip's
# memory, not thread stacks and arenas reserved at start-up.
_CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
# What of the gateway's environment a decoder process gets: enough to start Python and find the code, and
# nothing else (API keys, Redis URLs and tokens stay out of the reach of a decoder an attacker subverts).
_INHERITED = ("PATH", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR")


def _child_env() -> dict[str, str]:
    return {**{k: os.environ[k] for k in _INHERITED if k in os.environ}, **_CHILD_ENV}


# ------------------------------------------------------------------------------------ the decoder process


def _read_exactly(stream, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        piece = stream.read(size - len(data))
        if not piece:
            return None
        data += piece
    return bytes(data)


def _limit_self(memory_bytes: int) -> None:
    import resource

    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the gateway
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the gateway was already gone
            os._exit(1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    with open("/proc/self/statm") as statm:  # Linux; elsewhere RLIMIT_AS is not applied
        used = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + memory_bytes, resource.RLIM_INFINITY))


def _limit_cpu(cpu_s: float) -> None:
    """Allow this clip `cpu_s` CPU seconds beyond what the process used so far (SIGXCPU ends it)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + cpu_s) + 1, hard))


def serve(decode=None) -> None:
    """The decoder process: limit itself (argv: memory bytes, CPU seconds per clip), say it is ready,
    then decode clips from stdin until it closes. `decode` is gateway.audio.reference.decode_clip unless
    a test plants another."""
    from .pyav import PyAVMissing, pyav
    from .reference import InvalidReferenceAudio, decode_clip
    from .sandbox import close_inherited_descriptors, confine

    try:  # PyAV and FFmpeg's libraries load before the memory limit and the sandbox, as at module import
        pyav("decoding reference audio")
    except PyAVMissing:
        pass  # a stripped install: each clip is refused, saying why

    close_inherited_descriptors()
    decode = decode or decode_clip
    memory_bytes, cpu_s = int(sys.argv[1]), float(sys.argv[2])
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed by a library can corrupt the answers
    _limit_self(memory_bytes)
    confine()
    stdout.write(_READY)
    stdout.flush()
    while (head := _read_exactly(stdin, _REQUEST.size)) is not None:
        min_s, max_s, rate, length = _REQUEST.unpack(head)
        data = _read_exactly(stdin, length)
        if data is None:
            return
        _limit_cpu(cpu_s)
        try:
            answer = _OK, decode(data, min_s, max_s, rate).astype("<f4").tobytes()
        except InvalidReferenceAudio as refused:
            answer = _REFUSED, str(refused).encode()[:MAX_MESSAGE_BYTES]
        except PyAVMissing as missing:
            answer = _REFUSED, str(missing).encode()
        except MemoryError:
            answer = _REFUSED, b"the reference audio needs more memory to decode than a clip may use"
        except Exception as exc:  # noqa: BLE001 - whatever FFmpeg or numpy raise, the clip is refused
            answer = _REFUSED, f"the reference audio cannot be decoded ({type(exc).__name__})".encode()
        data = None
        stdout.write(_ANSWER.pack(answer[0], len(answer[1])))
        stdout.write(answer[1])
        stdout.flush()


if __name__ == "__main__":
    serve()
