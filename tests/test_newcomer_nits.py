"""Small things a newcomer met (issue 25, "Minor"): the Twilio bridge's open listener, the page's favicon,
and a keyless gateway's wording about keys."""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.gateway_server import free_port, running_gateway


TELEPHONY = Path(__file__).resolve().parent.parent / "clients" / "telephony"


def _twilio(*args: str) -> subprocess.Popen:
    """voxgate-twilio of this checkout (not whichever the environment installed), without a Twilio token."""
    env = {k: v for k, v in os.environ.items() if k != "TWILIO_AUTH_TOKEN"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TELEPHONY), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "voxgate_telephony.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_twilio_bridge_refuses_an_open_listener_without_the_twilio_token():
    """voxgate serve refuses 0.0.0.0 without keys; so does voxgate-twilio without --twilio-auth-token (before:
    it listened on 0.0.0.0 by default, unauthenticated, with no warning)."""
    process = _twilio("--host", "0.0.0.0", "--port", str(free_port()))
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 2
    assert "--twilio-auth-token" in output and "--insecure-no-auth" in output and "Traceback" not in output


class _Output:
    """The bridge's output, read on a thread so that the test can wait for a line with a deadline."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output

    def bound_port(self, deadline_s: float = 30) -> int:
        """The port the bridge says it bound. It is started on --port 0: a port picked here and passed in
        could be taken by another socket before the bridge binds it (CI once saw the bridge exit on that)."""
        deadline = time.monotonic() + deadline_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if found := re.search(r"Twilio bridge on \S+:(\d+) ", line):
                return int(found.group(1))
        raise AssertionError(f"the bridge did not say it listens (exit {self.process.poll()}): {''.join(self.seen)}")

    def rest(self) -> str:
        """All the output, once the process has ended."""
        while (line := self.lines.get(timeout=10)) is not None:
            self.seen.append(line)
        return "".join(self.seen)


def test_the_twilio_bridge_listens_on_loopback_by_default_and_anywhere_when_told():
    for args in ([], ["--host", "0.0.0.0", "--twilio-auth-token", "secret"], ["--host", "0.0.0.0", "--insecure-no-auth"]):
        process = _twilio("--port", "0", *args)
        output = _Output(process)
        try:
            port = output.bound_port()
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", port)) == 0, args
            if not args:  # the default is loopback only
                addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
                for address in addresses - {"127.0.0.1"}:
                    with socket.socket() as probe:
                        assert probe.connect_ex((address, port)) != 0, address
        finally:
            process.terminate()
        if "--insecure-no-auth" in args:
            assert "without --twilio-auth-token" in output.rest()  # said, not silent
        process.wait(timeout=10)


def test_the_page_has_a_favicon():
    with running_gateway("synthetic") as server:
        response = httpx.get(server.url + "/favicon.ico")
    assert response.status_code == 200 and response.content[:4] == b"\x00\x00\x01\x00"  # an ICO file


def test_a_keyless_gateway_does_not_speak_of_keys():
    with running_gateway("synthetic") as server:
        response = httpx.get(server.url + "/v1/audio/voices/nobody")
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "nobody" in message and "key" not in message
