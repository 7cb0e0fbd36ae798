"""Where a worker listens and how a gateway reaches it: addresses, the shared token, TLS.

Addresses are written as `unix:/path/to.sock` (or a bare absolute path), `tcp://HOST:PORT` or
`tls://HOST:PORT`. An address proves nothing about who answers at it, nor a connection about who dialled,
so where there is a shared token every connection starts with a handshake in which the worker proves it
holds the token, then the gateway (framing.py); the token itself never crosses the wire. Both proofs bind
the address the connection reached: for TCP the IP and port the gateway's socket is connected to (after
its name was resolved), for a Unix socket the path it dialled. A worker proves itself only for an address
it answers to: the one the connection reached on its side (a direct connection), its --advertise and its
--reachable-at addresses (a forwarder in front of it: a load balancer, a NAT or container port mapping),
host names among them resolved when it starts. So a listener at another address relaying the handshake to a
real worker gets no proof the gateway accepts, and is sent nothing but a nonce.

What that does not stop: whoever is on the network path to a worker's own address (or answers for its
host name, in a DNS the gateways use) sees, on plain TCP, the text and the audio that follow the
handshake, as anyone on that path does. Use `tls://` (the worker's certificate checked against `tls_ca`,
or the system's CAs, and the host name the gateway dials) for every worker on a network the gateway's
operator does not control.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from . import framing

SCHEMES = ("unix", "tcp", "tls")


@dataclass(frozen=True)
class WorkerAddress:
    scheme: str  # "unix", "tcp" or "tls"
    host: str = ""
    port: int = 0
    path: str = ""  # unix only

    @classmethod
    def parse(cls, text: str) -> "WorkerAddress":
        text = text.strip()
        if text.startswith("/"):
            return cls("unix", path=text)
        if text.startswith("unix:"):
            path = text[len("unix:"):]
            if path.startswith("//"):
                path = path[2:]
            if not path:
                raise ValueError(f"worker address {text!r} names no socket path")
            return cls("unix", path=path)
        parts = urlsplit(text)
        if parts.scheme not in ("tcp", "tls") or not parts.hostname:
            raise ValueError(f"worker address {text!r}: write unix:/path, tcp://HOST:PORT or tls://HOST:PORT")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"worker address {text!r}: {exc}") from None
        if port is None or (parts.path not in ("", "/")) or parts.query:
            raise ValueError(f"worker address {text!r}: write {parts.scheme}://HOST:PORT")
        return cls(parts.scheme, host=parts.hostname, port=port)

    def __str__(self) -> str:
        if self.scheme == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def is_network(self) -> bool:
        return self.scheme != "unix"

    @property
    def host_is_ip(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    @property
    def is_loopback(self) -> bool:
        if self.scheme == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def with_port(self, port: int) -> "WorkerAddress":
        return WorkerAddress(self.scheme, self.host, port, self.path)


def reached_address(scheme: str, sockaddr: object) -> WorkerAddress:
    """The TCP address a connected socket names (its peer's, from the gateway; its own, from the worker),
    with the IP written one way (an IPv4-mapped IPv6 address as IPv4, no scope): what the handshake binds."""
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return WorkerAddress(scheme, str(ip), port)


def normalized(address: WorkerAddress) -> WorkerAddress:
    """`address` with an IP host written as reached_address writes it (a name is left as it is)."""
    if address.scheme == "unix":
        return address
    try:
        return reached_address(address.scheme, (address.host, address.port))
    except ValueError:
        return WorkerAddress(address.scheme, address.host.lower(), address.port)


def listen_address(listen: str | None, socket_path: str | None = None) -> WorkerAddress:
    """A worker's --listen, or its older --socket PATH; by default the local socket gateways look for."""
    if socket_path:
        return WorkerAddress("unix", path=socket_path)
    return WorkerAddress.parse(listen or "unix:/tmp/voxgate-worker.sock")


def default_worker_id(listen: WorkerAddress) -> str:
    host = socket.gethostname()
    if listen.scheme == "unix":
        return f"{host}-{os.path.basename(listen.path)}"
    return f"{host}-{listen.port}"


def read_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The shared secret: given, else the first line of `token_file`, else $VOXGATE_WORKER_TOKEN; None if
    none is set. An empty token is refused (it would authenticate anyone)."""
    if token is None and token_file:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the worker token file {token_file}: {exc.strerror}") from None
        token = lines[0] if lines else ""
    if token is None:
        token = os.environ.get("VOXGATE_WORKER_TOKEN")
    if token is None:
        return None
    token = token.strip()
    if not token:
        raise ValueError("the worker token is empty")
    return token


def client_tls_context(ca_file: str | None = None) -> ssl.SSLContext:
    """What a gateway checks a tls:// worker with: its certificate chain against `ca_file` (or the system's
    CAs) and the host name it was dialled by."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def _peer_is_this_user(writer: asyncio.StreamWriter) -> bool:
    """Whether the process at the other end of a Unix socket runs as this process's user or as root (False
    where the platform cannot tell)."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None:
        return False
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    except OSError:
        return False
    return uid in (os.getuid(), 0)


class WorkerNotProven(ConnectionError):
    """The peer at a worker's address did not prove that it holds the token (or is another worker than the
    one expected there): nothing was sent to it but a nonce."""


class HandshakeDropped(ConnectionError):
    """The peer closed the connection before it answered the hello: what a worker does to a pending
    connection it drops for another (pending.py), so the Dialer tries again."""


DIAL_ATTEMPTS = 3  # handshakes tried per open() while the worker drops them (HandshakeDropped)


@dataclass(frozen=True)
class Dialer:
    """Opens authenticated connections to workers: one per request, as the framing wants (closing it is the
    cancel signal)."""

    token: str | None = None
    tls: ssl.SSLContext | None = None
    timeout_s: float = 5.0

    async def open(self, address: WorkerAddress, expect_id: str | None = None,
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection on which the request may be written at once. With a token, the worker has proved that
        it holds it (and, given `expect_id`, that it is that worker) before this returns; otherwise
        WorkerNotProven. A handshake the worker dropped unanswered is tried again, on a new connection (the
        newest is the last a worker drops), up to DIAL_ATTEMPTS times in all."""
        for attempt in range(1, DIAL_ATTEMPTS + 1):
            try:
                return await self._open_once(address, expect_id)
            except HandshakeDropped:
                if attempt == DIAL_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _open_once(self, address: WorkerAddress, expect_id: str | None,
                         ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if address.scheme == "unix":
            opening = asyncio.open_unix_connection(address.path, limit=framing.READ_LIMIT)
        elif address.scheme == "tcp":
            opening = asyncio.open_connection(address.host, address.port, limit=framing.READ_LIMIT)
        else:
            opening = asyncio.open_connection(address.host, address.port, limit=framing.READ_LIMIT,
                                              ssl=self.tls or client_tls_context(), server_hostname=address.host,
                                              ssl_handshake_timeout=self.timeout_s)
        try:
            reader, writer = await asyncio.wait_for(opening, self.timeout_s)
        except asyncio.TimeoutError:
            raise ConnectionError(f"no answer from {address} within {self.timeout_s:g} s") from None
        except ssl.SSLError as exc:
            raise ConnectionError(f"TLS with {address} failed: {exc.reason or exc}") from None
        if self.token is not None:
            try:
                await asyncio.wait_for(self._handshake(reader, writer, address, expect_id), self.timeout_s)
            except BaseException as exc:
                writer.close()
                if isinstance(exc, asyncio.TimeoutError):
                    raise WorkerNotProven(f"{address} did not finish the handshake within {self.timeout_s:g} s") from None
                raise
        return reader, writer

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: WorkerAddress,
                         expect_id: str | None) -> None:
        client_nonce = secrets.token_bytes(framing.NONCE_BYTES)
        if address.scheme == "unix" and expect_id is None and _peer_is_this_user(writer):
            # No round trip: the kernel vouches for the worker (framing.py).
            writer.write(framing.encode_json({"op": "hello", "nonce": client_nonce.hex(),
                                              "proof": framing.local_proof(self.token, client_nonce)}))
            return
        # What the connection reached: for TCP the peer's IP and port, not the name dialled (module doc).
        dialled = str(address if address.scheme == "unix" else
                      reached_address(address.scheme, writer.get_extra_info("peername")))
        writer.write(framing.encode_json({"op": "hello", "nonce": client_nonce.hex(), "to": dialled}))
        try:
            await writer.drain()
            frame = await framing.read_frame(reader, framing.MAX_AUTH_FRAME)
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise HandshakeDropped(f"{address} closed the connection in the handshake: {exc or type(exc).__name__}") \
                from None
        except framing.ProtocolError as exc:
            raise WorkerNotProven(f"{address} did not answer the handshake: {exc}") from None
        if frame is None:
            raise HandshakeDropped(f"{address} closed the connection in the handshake")
        try:
            answer = framing.decode_json(frame[1]) if frame[0] == framing.JSON else {}
            if answer.get("op") == "error" and answer.get("code") == "wrong_address":
                raise WorkerNotProven(f"{address}: the worker there is not reachable as {dialled} (a relay, or a "
                                      "forwarder the worker was not told of with --reachable-at)")
            if answer.get("op") == "error":
                raise WorkerNotProven(f"{address} refused the handshake: {str(answer.get('code'))[:64]}")
            if answer.get("op") != "hello" or not isinstance(answer.get("id"), str):
                raise WorkerNotProven(f"{address} did not answer the handshake")
            worker_nonce = framing.parse_nonce(answer.get("nonce"))
        except framing.ProtocolError as exc:
            raise WorkerNotProven(f"{address} did not answer the handshake: {exc}") from None
        worker_id = answer["id"]
        if not framing.proof_matches(answer.get("proof"),
                                     framing.worker_proof(self.token, client_nonce, worker_nonce, dialled, worker_id)):
            raise WorkerNotProven(f"{address} did not prove that it holds the worker token and answers at {dialled}")
        if expect_id is not None and worker_id != expect_id:
            raise WorkerNotProven(f"{address} proved to be worker {worker_id[:64]!r}, not {expect_id[:64]!r}")
        writer.write(framing.encode_json({"op": "auth", "proof": framing.gateway_proof(
            self.token, worker_nonce, client_nonce, dialled, worker_id)}))
