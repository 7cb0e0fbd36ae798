"""A reference-audio decoder process with faults planted in it, for tests/test_hostile_cloning.py:

    ReferenceDecoder(command=[sys.executable, "-m", "tests.planted_decoder"])

It is the gateway's own decoder process (gateway.audio.decoder.serve with its real limits) whose
decode, for a clip that contains one of the markers below, does what a decoder bug would do instead of
decoding; every other clip is decoded for real.
"""

from __future__ import annotations

import ctypes
import os
import time

from gateway.audio.reference import InvalidReferenceAudio, decode_clip
from gateway.audio.decoder import serve

# The markers (tests/test_hostile_cloning.py has the same).
SEGFAULT = b"PLANTED-SEGFAULT"  # reads address 0: SIGSEGV
ABORT = b"PLANTED-ABORT"  # os.abort(): SIGABRT
HANG = b"PLANTED-HANG"  # sleeps, never answers
SPIN = b"PLANTED-SPIN"  # burns CPU without end
ALLOCATE = b"PLANTED-ALLOCATE"  # asks for 8 GiB, then decodes what it was given
GARBAGE = b"PLANTED-GARBAGE"  # answers a length of 4 GiB
ENVIRONMENT = b"PLANTED-ENVIRONMENT"  # refuses the clip naming its environment's variables (LEAK: a secret's value)
# PLANTED-ESCAPE:PORT tries to reach beyond its clip - the parent's environment in /proc, a file of the host,
# a TCP connection to 127.0.0.1:PORT, a signal to the parent - and refuses the clip naming what it reached.
ESCAPE = b"PLANTED-ESCAPE:"


def planted(data: bytes, min_s: float, max_s: float, rate: int):
    if SEGFAULT in data:
        ctypes.string_at(0)
    if ABORT in data:
        os.abort()
    if HANG in data:
        time.sleep(3600)
    if SPIN in data:
        while True:
            pass
    if ALLOCATE in data:
        held = bytearray(8 << 30)  # noqa: F841 - only the allocation matters
    if GARBAGE in data:
        import struct
        import sys

        sys.__stdout__.buffer.write(struct.pack("<BI", 0, 0xFFFFFFFC))
        sys.__stdout__.buffer.flush()
        time.sleep(3600)
    if ENVIRONMENT in data:
        leak = any("secret" in value for value in os.environ.values())
        raise InvalidReferenceAudio(" ".join(sorted(os.environ)) + (" LEAK" if leak else ""))
    if ESCAPE in data:
        raise InvalidReferenceAudio("reached: " + " ".join(_escape(int(data.split(ESCAPE)[1][:5]))))
    return decode_clip(data, min_s, max_s, rate)


def _escape(port: int) -> list[str]:
    import socket

    reached = []
    for name, path in (("parent-environ", f"/proc/{os.getppid()}/environ"), ("etc-passwd", "/etc/passwd")):
        try:
            with open(path, "rb") as handle:
                handle.read(1)
            reached.append(name)
        except OSError:
            pass
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        reached.append("tcp-connect")
    except OSError:
        pass
    try:
        os.kill(os.getppid(), 0)
        reached.append("signal-parent")
    except OSError:
        pass
    return reached


if __name__ == "__main__":
    serve(planted)
