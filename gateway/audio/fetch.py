"""Fetching a reference clip from an http(s) URL (`ref_audio`, where the operator turned fetching on).

A URL a client names makes the gateway a client of whatever it points at, inside the operator's network.
So `ReferenceFetcher`:
- speaks http and https only, on every hop: a redirect elsewhere (ftp://, file://, ...) fails the fetch;
- resolves each hop's host itself and refuses it unless every address it resolves to is public (not
  loopback, private, link-local, shared, reserved or multicast; IPv4 inside IPv6 judged as IPv4) or in
  `allowed_networks`; then connects to that checked address (the TLS name and the Host header stay the
  URL's), so a name that resolves differently a moment later (DNS rebinding) reaches nothing unchecked;
- ends the whole fetch, redirects included, at `timeout_s` (a server that drips a byte every few
  seconds gets no more time), and takes at most `max_bytes`;
- fails every way with one message that says nothing of what was found (open or closed port, a status,
  the peer's words): a client cannot map the network through it. The reason is logged for the operator;
- runs at most `concurrency` fetches at once, on the event loop (no threads), apart from the decoder
  processes: slow URLs cannot hold up the clones that came with their audio.

Knows nothing of the rest of the gateway.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from urllib.parse import urljoin, urlsplit

import h11

from .reference import InvalidReferenceAudio

log = logging.getLogger("voxgate.reference_fetch")

FETCH_CONCURRENCY = 4  # URL fetches at once per replica
MAX_REDIRECTS = 5
MAX_HEAD_BYTES = 16 * 1024  # a response's status line and headers
_READ = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
FETCH_FAILED = "the reference audio could not be fetched from its URL"
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class _Failed(Exception):
    """Why a fetch failed, for the log only."""


def address_allowed(address: IPAddress, allowed: tuple[IPNetwork, ...] = ()) -> bool:
    """A public address, or one of `allowed` (the operator's allow-list)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None:
            address = embedded
    if any(address in network for network in allowed):
        return True
    return address.is_global and not address.is_multicast


class ReferenceFetcher:
    def __init__(self, *, max_bytes: int, timeout_s: float, allowed_networks: list[str] | tuple[str, ...] = (),
                 concurrency: int = FETCH_CONCURRENCY) -> None:
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.allowed = tuple(ipaddress.ip_network(n, strict=False) for n in allowed_networks)
        self._slots = asyncio.Semaphore(concurrency)
        self._tls = ssl.create_default_context()

    async def fetch(self, url: str) -> bytes:
        """The bytes at `url`. Raises InvalidReferenceAudio (always the same message)."""
        try:
            return await asyncio.wait_for(self._fetch(url), self.timeout_s)
        except asyncio.TimeoutError:
            reason = f"not done within {self.timeout_s:g} s"
        except _Failed as exc:
            reason = str(exc)
        except (OSError, ssl.SSLError, h11.ProtocolError, ValueError, UnicodeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        log.info("a reference audio URL was not fetched: %s", reason)
        raise InvalidReferenceAudio(FETCH_FAILED)

    async def _fetch(self, url: str) -> bytes:
        async with self._slots:
            for _ in range(MAX_REDIRECTS + 1):
                status, location, body = await self._get(url)
                if status == 200:
                    return body
                if status not in _REDIRECTS or location is None:
                    raise _Failed(f"answered HTTP {status}")
                url = urljoin(url, location)
            raise _Failed(f"more than {MAX_REDIRECTS} redirects")

    async def _address(self, host: str, port: int) -> str:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        if not addresses:
            raise _Failed(f"{host} has no address")
        refused = [a for a in addresses if not address_allowed(a, self.allowed)]
        if refused:
            raise _Failed(f"{host} resolves to {refused[0]}, which is not a public address nor allowed")
        return str(addresses[0])

    async def _get(self, url: str) -> tuple[int, str | None, bytes]:
        """(status, Location of a redirect, body of a 200) of one GET."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise _Failed(f"a {scheme or 'schemeless'} URL")
        host = parts.hostname
        if not host:
            raise _Failed("a URL without a host")
        port = parts.port or (443 if scheme == "https" else 80)
        address = await self._address(host, port)
        tls = self._tls if scheme == "https" else None
        reader, writer = await asyncio.open_connection(address, port, ssl=tls, server_hostname=host if tls else None)
        try:
            connection = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            headers = [("Host", parts.netloc.rpartition("@")[2]), ("User-Agent", "voxgate"), ("Accept", "*/*"),
                       ("Connection", "close")]
            writer.write(connection.send(h11.Request(method="GET", target=target, headers=headers)))
            writer.write(connection.send(h11.EndOfMessage()))
            await writer.drain()
            status, body = 0, bytearray()
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(await reader.read(_READ))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                    if status != 200:  # its body is not wanted
                        location = dict(event.headers).get(b"location")
                        return status, location.decode("ascii") if location else None, b""
                    length = dict(event.headers).get(b"content-length")
                    if length is not None and int(length) > self.max_bytes:
                        raise _Failed(f"{int(length)} bytes, over {self.max_bytes}")
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > self.max_bytes:
                        raise _Failed(f"over {self.max_bytes} bytes")
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, None, bytes(body)
        finally:
            writer.close()
