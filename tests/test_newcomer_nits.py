"""Small things a newcomer met (issue 25, "Minor"): the Twilio bridge's open listener, the page's favicon,
and a keyless gateway's wording about keys."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def _listens(process: subprocess.Popen, port: int, deadline_s: float = 30) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def test_the_twilio_bridge_listens_on_loopback_by_default_and_anywhere_when_told():
    for args in ([], ["--host", "0.0.0.0", "--twilio-auth-token", "secret"], ["--host", "0.0.0.0", "--insecure-no-auth"]):
        port = free_port()
        process = _twilio("--port", str(port), *args)
        try:
            assert _listens(process, port), (args, process.poll())
            if not args:  # the default is loopback only
                addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
                for address in addresses - {"127.0.0.1"}:
                    with socket.socket() as probe:
                        assert probe.connect_ex((address, port)) != 0, address
        finally:
            process.terminate()
            output, _ = process.communicate(timeout=10)
        if "--insecure-no-auth" in args:
            assert "without --twilio-auth-token" in output  # said, not silent


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
