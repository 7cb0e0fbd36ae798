"""`voxgate-twilio`: run the Twilio Media Streams bridge with a small demo agent.

    voxgate-twilio --gateway ws://127.0.0.1:8000 --port 8080 --public-url wss://example.ngrok.app \
        --greeting "Thanks for calling. Press any key."

Point a Twilio number's voice webhook (HTTP GET) at https://<public host>/twiml. The demo agent speaks
the greeting when the call's stream starts and reads back DTMF digits; with --barge-in, caller speech
interrupts it.

The bridge listens on 127.0.0.1 by default (a tunnel such as ngrok reaches it there). On any other address
it needs --twilio-auth-token (or TWILIO_AUTH_TOKEN), with which every request must carry Twilio's
signature: without it anyone who finds the port can hold calls open and speak through the gateway on this
bridge's API key, so it refuses to start unless told --insecure-no-auth.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os

import voxgate_client as vg

from .bargein import EnergyBargeIn
from .bridge import Call, TwilioBridge


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxgate-twilio", description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", default=os.environ.get("VOXGATE_URL", "ws://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("VOXGATE_API_KEY"))
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on; another than loopback needs --twilio-auth-token")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port (the log line says which)")
    parser.add_argument("--public-url", help="wss:// base URL Twilio reaches this bridge on")
    parser.add_argument(
        "--twilio-auth-token", default=os.environ.get("TWILIO_AUTH_TOKEN"),
        help="check X-Twilio-Signature on every request (or TWILIO_AUTH_TOKEN)",
    )
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="listen on a non-loopback --host without --twilio-auth-token (anyone may connect)")
    parser.add_argument("--voice")
    parser.add_argument("--language")
    parser.add_argument("--greeting", default="Hello! You are talking to Voxgate. Press a key on your phone.")
    parser.add_argument("--barge-in", action="store_true", help="interrupt the agent when the caller speaks")
    parser.add_argument("--barge-in-dbfs", type=float, default=-30.0)
    parser.add_argument("--log-level", default="info")
    return parser


async def run(args: argparse.Namespace) -> None:
    async def demo_agent(call: Call) -> None:
        logging.info("call %s started (stream %s)", call.call_sid, call.stream_sid)
        await call.say(args.greeting)

    async def on_dtmf(call: Call, digit: str) -> None:
        await call.interrupt()
        await call.say(f"You pressed {digit}.")

    bridge = TwilioBridge(
        args.gateway,
        config=vg.SessionConfig(voice=args.voice, language=args.language),
        on_call=demo_agent,
        on_dtmf=on_dtmf,
        barge_in_factory=(lambda: EnergyBargeIn(args.barge_in_dbfs)) if args.barge_in else None,
        client_options={"api_key": args.api_key} if args.api_key else {},
    )
    server = await bridge.serve(
        args.host, args.port, public_url=args.public_url, auth_token=args.twilio_auth_token
    )
    port = server.sockets[0].getsockname()[1]  # the bound one: --port 0 lets the OS pick without a race
    logging.info("Twilio bridge on %s:%d (stream /twilio, TwiML /twiml) -> %s", args.host, port, args.gateway)
    await server.serve_forever()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not is_loopback(args.host) and not args.twilio_auth_token and not args.insecure_no_auth:
        parser.error(f"--host {args.host} is reachable from other machines: pass --twilio-auth-token (or set"
                     " TWILIO_AUTH_TOKEN) so that only Twilio's signed requests are served, listen on 127.0.0.1"
                     " behind a tunnel, or accept anyone with --insecure-no-auth")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not is_loopback(args.host) and not args.twilio_auth_token:
        logging.warning("listening on %s without --twilio-auth-token (--insecure-no-auth): anyone who reaches"
                        " the port can open calls through the gateway", args.host)
    try:
        asyncio.run(run(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
