"""bench/gateway_overhead.py: direct backend calls vs the same prompts through a real gateway."""

from __future__ import annotations

import asyncio

from bench.gateway_overhead import build_parser, markdown, measure
from tests.gateway_server import running_gateway


def test_direct_and_websocket_measure_the_same_audio() -> None:
    with running_gateway("synthetic") as server:
        args = build_parser().parse_args(["--url", server.ws_url, "--backend", "synthetic", "--count", "4",
                                          "--warmup", "1", "--sentences", "1-2", "--seed", "5"])
        summary = asyncio.run(measure(args, server.ws_url))
    assert summary["pairs"] == 4 and summary["failed"] == 0
    # The synthetic backend is deterministic: both paths yield the same audio for each prompt.
    assert summary["same_audio_bytes"] == 4
    for row in summary["requests"]:
        assert 0 <= row["direct_ttfb_s"] <= row["direct_e2e_s"]
        assert 0 <= row["ws_ttfb_s"] <= row["ws_e2e_s"]
    added = summary["added"]["ttfb_s"]
    assert added["n"] == 4
    assert summary["websocket"]["ttfb_s"]["p50"] - summary["direct"]["ttfb_s"]["p50"] < 1.0
    assert "| TTFB (ms) |" in markdown(summary)
