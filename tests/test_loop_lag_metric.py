"""/metrics says how late the gateway's event loop runs (issue 22: under load, is it the loop that stalls or
the engine?): a loop blocked for half a second shows up in voxgate_event_loop_lag_seconds."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_server import running_gateway


def _lag_histogram(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "voxgate_event_loop_lag_seconds")
    out = {}
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            out[sample.labels["le"]] = sample.value
        elif sample.name.endswith("_count"):
            out["count"] = sample.value
    return out


def test_a_blocked_event_loop_shows_in_the_lag_histogram():
    with running_gateway("synthetic") as server:
        deadline = time.monotonic() + 30
        while _lag_histogram(server.url)["count"] < 2:  # the watch runs from start-up on
            assert time.monotonic() < deadline, "no loop-lag samples"
            time.sleep(0.05)
        before = _lag_histogram(server.url)
        late_before = before["count"] - before["0.25"]  # samples later than 250 ms (a loaded machine may have some)
        server.loop.call_soon_threadsafe(time.sleep, 0.5)  # what a CPU-bound call on the loop does
        while True:
            after = _lag_histogram(server.url)
            late = after["count"] - after["0.25"] - late_before
            if late:
                break
            assert time.monotonic() < deadline, "the blocked loop was never seen late"
            time.sleep(0.05)
    assert late >= 1 and after["2.5"] == after["count"]


def test_bucket_quantiles_interpolate_within_the_bucket_and_the_split_reads_each_family():
    from bench.engine_load import bucket_quantiles, latency_split

    inf = float("inf")
    assert bucket_quantiles({0.01: 10, 0.02: 50, 0.05: 95, 0.1: 99, inf: 100}) == {
        "count": 100, "p50": 20.0, "p95": 50.0, "p99": 100.0}
    assert bucket_quantiles({0.01: 0, 0.02: 40, inf: 40}, (0.5,)) == {"count": 40, "p50": 15.0}
    assert bucket_quantiles({0.01: 0, inf: 0}) is None
    before = {("voxgate_ttfa_seconds_bucket", (("le", "0.02"), ("transport", "http"))): 5.0,
              ("voxgate_ttfa_seconds_bucket", (("le", "+Inf"), ("transport", "http"))): 5.0}
    after = {("voxgate_ttfa_seconds_bucket", (("le", "0.02"), ("transport", "http"))): 25.0,
             ("voxgate_ttfa_seconds_bucket", (("le", "+Inf"), ("transport", "http"))): 25.0,
             ("voxgate_ttfa_seconds_bucket", (("le", "0.02"), ("transport", "websocket"))): 3.0,
             ("voxgate_ttfa_seconds_bucket", (("le", "+Inf"), ("transport", "websocket"))): 4.0,
             ("voxgate_engine_first_chunks_total", (("le", "0.01"),)): 10.0,
             ("voxgate_engine_first_chunks_total", (("le", "+Inf"),)): 10.0}
    split = latency_split(before, after)
    assert split["gateway_ttfa_ms"]["http"] == {"count": 20, "p50": 10.0, "p95": 19.0, "p99": 19.8}
    assert split["gateway_ttfa_ms"]["websocket"]["count"] == 4
    assert split["engine_first_chunk_ms"]["count"] == 10
