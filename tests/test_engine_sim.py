"""bench/engine_sim.py: the real engine against simulated time keeps the invariants of the time it simulates."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")  # the engine's runner module imports torch

from bench.engine_load import BENCH_MAX_ACTIVE, BENCH_MAX_LEN, BENCH_RUNNER_OPTIONS  # noqa: E402
from bench.engine_sim import CostTable, SimOptions, run_rate  # noqa: E402
from tts_backend.engine import engine as engine_module  # noqa: E402
from tts_backend.engine.runner import Qwen3RunnerConfig  # noqa: E402

DECODE_BUCKETS = ("2", "4", "8", "16", "24", "32", "48", "64", "96", "128")
TALKER_MS, PREDICTOR_MS, PREFILL_MS = 2.0, 3.0, 3.0


def small_table() -> CostTable:
    """Round figures shaped like bench/engine_step.py's: a frame is the Talker step plus the predictor."""
    table = {
        "talker_ms": {b: TALKER_MS for b in DECODE_BUCKETS},
        "code_predictor_ms": {b: PREDICTOR_MS for b in DECODE_BUCKETS},
        "frame_ms": {b: TALKER_MS + PREDICTOR_MS for b in DECODE_BUCKETS},
        "prefill_ms": {f"{n}x{p}": PREFILL_MS for n in (2, 4, 8) for p in (32, 64)},
        "codec_ms": {f"{n}x{f}": 1.5 + 0.25 * f for n in (2, 4, 8, 16) for f in (2, 4, 8, 12)},
    }
    config = Qwen3RunnerConfig(max_slots=BENCH_MAX_ACTIVE, max_len=BENCH_MAX_LEN, **BENCH_RUNNER_OPTIONS)
    return CostTable(table, config, "test table")


def simulate(costs: CostTable, rate: float = 3.0, **options) -> dict:
    options = SimOptions(warmup=0.5, duration=2.0, seed=1, **options)
    return run_rate(rate, options, costs=costs)


def test_every_request_gets_its_frame_cap_of_audio_and_time_covers_the_device():
    costs = small_table()
    entry = simulate(costs)
    requests = entry["requests"]
    assert len(requests) >= 4  # a Poisson run of 2.5 s at 3 RPS, seed 1
    for r in requests:
        assert r.completed and not r.errors, r.errors
        assert r.audio_s == pytest.approx(r.expected_audio_s), r.index  # random weights: the cap, no EOS
    sim = entry["simulator"]
    # The generation device is one queue: the simulated time spans at least the device seconds charged to it.
    assert sim["simulated_s"] >= sim["generation_device_s"] > 0
    # The engine read the simulated clock (its perf_counter pointed there) only for the run.
    assert engine_module.time is time


@pytest.mark.parametrize("quick_start_below", [0, 16])
def test_audible_ttfa_is_prefill_the_first_chunks_frames_and_a_codec_call_at_least(quick_start_below):
    costs = small_table()
    # No host time measured here (it would pad every figure): the device and the runner's fixed host work set
    # the times. The first audio needs the prefill (codebook 0 of frame 0) and the predictor (frame 0); with
    # the plain schedule a Talker step and the predictor (frame 1) too; then the codec on the first chunk: 2
    # frames, or 1 where the engine starts lightly loaded requests quick (EngineConfig.quick_start_below).
    entry = simulate(costs, host_factor=0.0, launch_us=0.0, quick_start_below=quick_start_below)
    if quick_start_below:
        floor_s = (PREFILL_MS + PREDICTOR_MS + costs.codec_ms(1, 1)) / 1000
    else:
        floor_s = (PREFILL_MS + PREDICTOR_MS + TALKER_MS + PREDICTOR_MS + costs.codec_ms(1, 2)) / 1000
    ttfa = [r.audible_ttfa_s for r in entry["requests"]]
    assert all(t is not None for t in ttfa)
    assert min(ttfa) >= floor_s
    # A request alone on the engine gets it within one more frame (its audio is collected at the next step).
    assert min(ttfa) < floor_s + (TALKER_MS + PREDICTOR_MS) / 1000
    # ... and at this rate nothing runs dry.
    assert entry["summary"]["underrun_events"] == 0


def test_a_device_twenty_times_slower_underruns():
    # A frame now takes 100 ms of device time, more than the 80 ms of audio it makes: the listener runs dry.
    entry = simulate(small_table().scaled(20))
    assert entry["summary"]["underrun_events"] > 0
    assert all(r.completed for r in entry["requests"])


def test_agent_replies_pushed_word_by_word_wait_for_text_and_get_their_whole_cap():
    # Replies of 2 sentences at 10 words/s: the engine makes frames far faster than the words come, so its
    # streams wait for text (the streaming-text path), and each reply still ends with the cap of its whole text.
    entry = simulate(small_table(), rate=2.0, agent_sentences=2, words_per_s=10.0)
    requests = entry["requests"]
    assert len(requests) >= 3
    for r in requests:
        assert r.completed and not r.errors, r.errors
        assert r.audio_s == pytest.approx(r.expected_audio_s), r.index
        assert r.audible_ttfa_after_sentence_s is not None
    assert entry["engine"]["text"]["waits"] > 0


def test_a_codec_call_of_an_uncaptured_count_costs_its_captured_pieces():
    # The runner captures 1, 2, 4, 8 and 12 frames (Qwen3RunnerConfig.codec_frames) and runs 7 as 4 + 2 + 1:
    # three calls, each paying the fixed part (1.5 ms in this table), not one call interpolated at 7.
    costs = small_table()
    assert costs.codec_ms(2, 4) == pytest.approx(1.5 + 0.25 * 4)
    assert costs.codec_ms(2, 7) == pytest.approx(3 * 1.5 + 0.25 * 7)
    assert costs.codec_ms(2, 12) == pytest.approx(1.5 + 0.25 * 12)


def test_scheduler_overrides_reach_the_simulated_engine():
    from bench.engine_sim import _scheduler_overrides

    assert _scheduler_overrides(["prefill_gather_s=0.02", "prefill_gather_streams=8"]) == [
        ("prefill_gather_s", 0.02), ("prefill_gather_streams", 8)]
    with pytest.raises(SystemExit):
        _scheduler_overrides(["max_batch=3"])
    # Gathering arrivals while any stream steps holds most prefills back: fewer, larger prefill batches.
    costs = small_table()
    plain = simulate(costs, rate=20.0, host_factor=0.0)
    gathered = simulate(costs, rate=20.0, host_factor=0.0,
                        scheduler=(("prefill_gather_s", 0.05), ("prefill_gather_streams", 1)))
    assert gathered["engine"]["stages"]["PREFILL"]["batches"] < plain["engine"]["stages"]["PREFILL"]["batches"]


def test_with_the_first_chunk_lane_every_request_gets_its_audio_and_first_chunks_use_the_lane():
    costs = small_table()
    # 30 RPS of this table keeps two codec batches queued often enough that first chunks meet a full queue.
    entry = simulate(costs, rate=30.0, first_chunk_lane=True)
    requests = entry["requests"]
    assert len(requests) >= 40
    for r in requests:
        assert r.completed and not r.errors, r.errors
        assert r.audio_s == pytest.approx(r.expected_audio_s), r.index
    lane = entry["engine"]["codec_lane_batches"]
    assert 0 < lane < entry["engine"]["stages"]["CODEC"]["batches"]
    sim = entry["simulator"]
    assert sim["simulated_s"] >= sim["generation_device_s"] > 0
    # The floor of a first audio holds on the lane too: prefill, two frames, then its codec call.
    alone = simulate(costs, first_chunk_lane=True, host_factor=0.0, launch_us=0.0, quick_start_below=0)
    floor_s = (PREFILL_MS + PREDICTOR_MS + TALKER_MS + PREDICTOR_MS + costs.codec_ms(1, 2)) / 1000
    assert min(r.audible_ttfa_s for r in alone["requests"]) >= floor_s
    assert alone["summary"]["underrun_events"] == 0
