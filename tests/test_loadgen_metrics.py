"""The load tool's measurement functions, checked on inputs whose answers are known by construction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.loadgen import (
    RequestResult,
    Workload,
    across_seeds,
    audible_onset,
    growing_backlog,
    nearest_rank,
    play_time_of,
    poisson_schedule,
    request_metrics,
    simulate_playback,
    summarize,
    token_pieces,
)

RATE = 24000


def tone(seconds: float, dbfs: float, rate: int = RATE, freq: float = 300.0) -> np.ndarray:
    """A sine whose RMS is `dbfs` relative to 32768."""
    amplitude = 10 ** (dbfs / 20) * math.sqrt(2) * 32768
    t = np.arange(int(round(seconds * rate))) / rate
    return amplitude * np.sin(2 * np.pi * freq * t)


def pcm(*parts: np.ndarray) -> np.ndarray:
    return np.round(np.concatenate(parts)).astype(np.int16)


# -- percentiles ---------------------------------------------------------------------------------------


def test_nearest_rank_percentiles() -> None:
    values = list(range(1, 101))  # 1..100
    assert nearest_rank(values, 50) == 50
    assert nearest_rank(values, 95) == 95
    assert nearest_rank(values, 99) == 99
    assert nearest_rank(values, 100) == 100
    assert nearest_rank(values, 0) == 1
    # Nearest rank picks an observed value, never an interpolation.
    assert nearest_rank([10, 20, 30, 40], 50) == 20
    assert nearest_rank([10, 20, 30, 40], 51) == 30
    assert nearest_rank([3.0, 1.0, 2.0], 95) == 3.0
    assert nearest_rank([7], 99) == 7
    assert math.isnan(nearest_rank([], 50))


# -- audible onset -------------------------------------------------------------------------------------


def test_onset_is_the_first_of_two_loud_windows() -> None:
    audio = pcm(np.zeros(int(0.300 * RATE)), tone(0.5, -20))
    onset = audible_onset(audio, RATE)
    # Windows start every 10 ms; the first window with enough loud samples starts at 290 or 300 ms.
    assert onset is not None and 0.280 <= onset <= 0.300


def test_quiet_audio_below_minus_45_dbfs_is_not_audible() -> None:
    assert audible_onset(pcm(tone(1.0, -50)), RATE) is None
    assert audible_onset(pcm(tone(1.0, -44)), RATE) == 0.0


def test_dc_offset_is_not_sound() -> None:
    audio = pcm(np.full(RATE // 2, 3000.0), np.full(RATE // 4, 3000.0) + tone(0.25, -30))
    onset = audible_onset(audio, RATE)
    assert onset is not None and 0.480 <= onset <= 0.500


def test_a_single_click_is_not_an_onset() -> None:
    """A loud click lies in two overlapping windows and counts; a faint one does not lift the RMS of any
    20 ms window to -45 dBFS, so the onset is the speech that follows."""
    click = np.zeros(RATE)
    start = int(0.403 * RATE)
    click[start : start + int(0.002 * RATE)] = 20000  # 2 ms inside window [400, 420) and [390, 410)
    speech = tone(0.3, -25)
    audio = pcm(click, speech)
    onset = audible_onset(audio, RATE)
    # The click lies in two overlapping windows (390 and 400 ms), which are consecutive: it is audible.
    assert onset == pytest.approx(0.390, abs=1e-9)
    # A click too quiet to lift two windows is ignored and the onset is the speech.
    click[start : start + int(0.002 * RATE)] = 600
    onset = audible_onset(pcm(click, speech), RATE)
    assert onset is not None and onset >= 0.98


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 48000])
def test_onset_at_other_rates(rate: int) -> None:
    audio = pcm(np.zeros(int(0.120 * rate)), tone(0.3, -30, rate))
    onset = audible_onset(audio, rate)
    assert onset is not None and 0.100 <= onset <= 0.121


def test_too_short_audio_has_no_onset() -> None:
    assert audible_onset(pcm(tone(0.01, -10)), RATE) is None


# -- playback simulation -------------------------------------------------------------------------------


def test_playback_without_underruns() -> None:
    # 100 ms pieces arriving every 50 ms: the buffer only grows.
    pieces = [(0.05 * i, 0.1) for i in range(10)]
    playback = simulate_playback(pieces)
    assert playback.underruns == 0 and playback.total_stall_s == 0.0
    assert playback.play_starts == pytest.approx([0.1 * i for i in range(10)])


def test_playback_counts_each_late_piece_and_restarts_the_timeline() -> None:
    pieces = [(0.0, 0.1), (0.15, 0.1), (0.20, 0.1), (0.6, 0.2), (0.65, 0.1)]
    playback = simulate_playback(pieces)
    # 0.0-0.1 plays; piece 2 arrives 50 ms late -> plays 0.15-0.25; piece 3 on time -> 0.25-0.35;
    # piece 4 arrives 250 ms late -> 0.6-0.8; piece 5 on time.
    assert playback.underruns == 2
    assert playback.total_stall_s == pytest.approx(0.30)
    assert playback.longest_stall_s == pytest.approx(0.25)
    assert playback.play_starts == pytest.approx([0.0, 0.15, 0.25, 0.6, 0.8])
    # Each silence: when it began (the missed deadline) and how long it lasted.
    assert [tuple(pytest.approx(x) for x in stall) for stall in playback.stalls] == [(0.1, 0.05), (0.35, 0.25)]


def test_a_disturbance_finds_the_silences_of_the_streams_playing_then() -> None:
    from bench.engine_load import listeners_silences

    def stream(origin: float, pieces: list[tuple[float, float]]) -> dict:
        playback = simulate_playback(pieces)
        return {"audio_origin_perf": origin, "ttfb_s": pieces[0][0], "e2e_s": pieces[-1][0],
                "audio_s": sum(duration for _, duration in pieces), "total_stall_s": playback.total_stall_s,
                "stalls": [[at, length] for at, length in playback.stalls]}

    at = 100.0
    streams = [
        stream(99.0, [(0.0, 1.0), (1.2, 0.5), (1.7, 0.1)]),  # playing at the signal, then 200 ms silent
        stream(99.5, [(0.0, 1.0), (0.9, 0.5), (1.4, 0.1)]),  # playing, never silent
        stream(98.0, [(0.0, 0.1), (0.5, 2.0), (2.4, 0.1)]),  # playing; silent before the signal, not after
        stream(99.9, [(0.0, 2.5), (3.0, 0.1)]),  # playing; silent only after the window
        stream(99.5, [(0.0, 1.0), (0.2, 0.5)]),  # all its audio came before the signal; its listener plays on
        stream(101.0, [(0.0, 0.1), (0.3, 0.1)]),  # began after the signal
        stream(97.0, [(0.0, 0.1), (1.0, 0.1)]),  # its playback (0.9 s silent in it) ended before it
    ]
    heard = listeners_silences(streams, at)
    assert heard == {"n": 5, "heard_any": 1, "p50": 0.0, "p99": pytest.approx(200.0), "max": pytest.approx(200.0),
                     "window_s": 2.0}
    assert listeners_silences(streams, None) is None


def test_piece_arriving_exactly_at_the_deadline_is_not_an_underrun() -> None:
    assert simulate_playback([(0.0, 0.25), (0.25, 0.25)]).underruns == 0


def test_play_time_of_an_offset_follows_the_playback_timeline() -> None:
    pieces = [(0.0, 0.1), (0.3, 0.1)]
    playback = simulate_playback(pieces)
    assert play_time_of(0.05, pieces, playback) == pytest.approx(0.05)
    # The second piece starts playing at its (late) arrival.
    assert play_time_of(0.15, pieces, playback) == pytest.approx(0.35)
    assert math.isnan(play_time_of(0.5, pieces, playback))


# -- per-request metrics -------------------------------------------------------------------------------


def test_request_metrics_from_frames() -> None:
    # 200 ms of silence then a tone, sent as 100 ms frames; the first frame arrives at 80 ms and the
    # rest every 60 ms (faster than real time). The first frame is one byte short of its last sample.
    audio = pcm(np.zeros(int(0.2 * RATE)), tone(0.4, -20))
    data = audio.tobytes()
    frame = int(0.1 * RATE) * 2
    sizes = [frame - 1, frame + 1, frame, frame, frame, frame]
    assert sum(sizes) == len(data)
    arrivals = [0.08 + 0.06 * i for i in range(len(sizes))]
    result = request_metrics(RequestResult(0, ["x"], 10, True, completed=True), list(zip(arrivals, sizes)), 2, RATE, audio)
    assert result.ttfb_s == pytest.approx(0.08)
    assert result.first_playable_s == pytest.approx(0.08)
    assert result.whole_samples is False
    assert result.audio_s == pytest.approx(0.6)
    # Playback starts at 80 ms; the onset sits 190-200 ms into the audio and plays 190-200 ms later.
    assert 0.08 + 0.19 <= result.audible_ttfa_s <= 0.08 + 0.2 + 1e-9
    assert result.e2e_s == pytest.approx(arrivals[-1])
    assert result.rtf == pytest.approx(arrivals[-1] / 0.6)
    assert result.underruns == 0
    assert not result.ok  # partial samples in a frame


def test_first_playable_waits_for_a_whole_sample() -> None:
    frames = [(0.010, 1), (0.030, 1), (0.050, 4798)]
    audio = pcm(tone(0.1, -20))
    result = request_metrics(RequestResult(0, [], 1, True, completed=True), frames, 2, RATE, audio)
    assert result.ttfb_s == pytest.approx(0.010)
    assert result.first_playable_s == pytest.approx(0.030)


def test_slow_frames_give_underruns_and_a_late_audible_start() -> None:
    audio = pcm(tone(0.3, -20))
    frame = int(0.1 * RATE) * 2
    frames = [(0.1, frame), (0.5, frame), (0.9, frame)]  # 100 ms of audio every 400 ms
    result = request_metrics(RequestResult(0, [], 1, True, completed=True), frames, 2, RATE, audio)
    assert result.underruns == 2
    assert result.total_stall_s == pytest.approx(0.6)
    assert result.longest_stall_s == pytest.approx(0.3)
    assert result.audible_ttfa_s == pytest.approx(0.1)


def test_request_without_audio() -> None:
    result = request_metrics(RequestResult(0, [], 1, True, completed=True), [], 2, RATE, np.zeros(0, np.int16))
    assert result.ttfb_s is None and result.audible_ttfa_s is None and result.e2e_s is None
    assert not result.ok


# -- run summary ---------------------------------------------------------------------------------------


def finished(index: int, ttfa: float, **overrides) -> RequestResult:
    base = dict(index=index, prompt_ids=[], chars=10, measured=True, ttfb_s=ttfa, first_playable_s=ttfa,
                audible_ttfa_s=ttfa, e2e_s=1.0, audio_s=2.0, rtf=0.5, bytes=96000, completed=True)
    base.update(overrides)
    return RequestResult(**base)


def test_summary_passes_a_clean_run() -> None:
    results = [finished(i, 0.1 + 0.01 * i) for i in range(20)] + [finished(99, 5.0, measured=False)]
    summary = summarize(results, wall_s=10.0, scheduled=20)
    assert summary["passed"], summary["fail_reasons"]
    assert summary["requests"] == 20
    assert summary["audible_ttfa_s"]["p50"] == pytest.approx(0.19)
    assert summary["audible_ttfa_s"]["p95"] == pytest.approx(0.28)  # rank ceil(0.95 * 20) = 19
    assert summary["audio_s_per_wall_s"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    "broken,reason",
    [
        (dict(underruns=1, total_stall_s=0.1, longest_stall_s=0.1), "underruns"),
        (dict(errors=["synthesis_failed"]), "failed"),
        (dict(bytes=0, audio_s=0.0), "failed"),
        (dict(whole_samples=False), "failed"),
        (dict(completed=False), "failed"),
    ],
)
def test_summary_fails_on_any_bad_request(broken: dict, reason: str) -> None:
    results = [finished(i, 0.1) for i in range(9)] + [finished(9, 0.1, **broken)]
    summary = summarize(results, wall_s=10.0, scheduled=10)
    assert not summary["passed"]
    assert any(reason in r for r in summary["fail_reasons"])


def test_summary_fails_when_scheduled_requests_never_started() -> None:
    summary = summarize([finished(i, 0.1) for i in range(8)], wall_s=5.0, scheduled=10)
    assert not summary["passed"] and "never started" in summary["fail_reasons"][0]


def test_growing_backlog_detection() -> None:
    steady = [(0.25 * i, 3 + (i % 3)) for i in range(240)]
    growing = [(0.25 * i, 2 + i // 8) for i in range(240)]
    assert not growing_backlog(steady)
    assert growing_backlog(growing)
    assert not growing_backlog(growing[:20])  # too short to tell
    summary = summarize([finished(i, 0.1) for i in range(5)], wall_s=60.0, in_flight=growing)
    assert not summary["passed"] and summary["growing_backlog"]


def test_across_seeds_takes_the_median_of_each_seed_percentile() -> None:
    summaries = []
    for ttfa in (0.1, 0.3, 0.2):
        summaries.append(summarize([finished(i, ttfa) for i in range(10)], wall_s=1.0))
    combined = across_seeds(summaries)
    assert combined["audible_ttfa_s"]["p95"] == pytest.approx(0.2)
    assert combined["passed"]


# -- workload ------------------------------------------------------------------------------------------


def test_poisson_schedule_is_seeded_and_has_the_right_rate() -> None:
    a = poisson_schedule(4.0, 500.0, seed=3)
    assert a == poisson_schedule(4.0, 500.0, seed=3)
    assert a != poisson_schedule(4.0, 500.0, seed=4)
    assert all(0 < x < 500 for x in a) and a == sorted(a)
    assert 1850 < len(a) < 2150  # 2000 expected, sd about 45
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.06)


def test_workload_is_seeded_and_joins_consecutive_prompts() -> None:
    prompts = [{"id": f"p{i}", "text": f"Sentence number {i}."} for i in range(50)]
    one = Workload(prompts, seed=1, sentences=(2, 6))
    two = Workload(prompts, seed=1, sentences=(2, 6))
    specs = [one.request(i) for i in range(30)]
    assert [two.request(i) for i in range(30)] == specs
    for spec in specs:
        assert 2 <= len(spec.prompt_ids) <= 6
        numbers = [int(p[1:]) for p in spec.prompt_ids]
        assert all((b - a) % 50 == 1 for a, b in zip(numbers, numbers[1:]))
        assert spec.text == " ".join(f"Sentence number {n}." for n in numbers)
    assert [Workload(prompts, 2, (2, 6)).request(i) for i in range(30)] != specs


@pytest.mark.parametrize("text", ["Hello there, how are you today?", "Extraordinarily long words: antidisestablishment.",
                                  "  leading and trailing  ", "Dr. Smith paid $3.50 at 5 p.m."])
def test_token_pieces_rebuild_the_text(text: str) -> None:
    pieces = token_pieces(text)
    assert "".join(pieces) == text
    assert all(len(p.strip()) <= 6 for p in pieces)


def test_a_moved_streams_pause_is_its_gap_across_the_signal_less_its_usual_gap(tmp_path) -> None:
    from bench.engine_load import pauses_across, pool_failovers

    log = tmp_path / "gateway.log"
    log.write_text('{"message": "failover session=a sentence=0 from=w1 to=w2 pause_ms=61.0 resumed=True"}\n'
                   '{"message": "failover session=c sentence=1 from=w1 to=w2 pause_ms=70.0 resumed=False"}\n'
                   '{"message": "worker w1 has stopped after draining"}\n')
    assert pool_failovers(log) == [("a", 61.0), ("c", 70.0)]
    assert pool_failovers(tmp_path / "missing.log") == []
    at = 100.0
    requests = [
        # moved: frames every 80 ms, then 200 ms across the signal: a pause of 120 ms
        {"session_id": "a", "audio_origin_perf": 99.0, "arrivals": [0.0, 0.08, 0.16, 0.24, 0.32, 0.40, 0.48,
                                                                     0.56, 0.64, 0.72, 0.80, 0.88, 0.96, 1.16, 1.24]},
        # not moved (the survivor's): not counted whatever its gap
        {"session_id": "b", "audio_origin_perf": 99.0, "arrivals": [0.0, 0.5, 0.9, 1.5, 2.0]},
        # moved, but its audio had ended before the signal
        {"session_id": "c", "audio_origin_perf": 98.0, "arrivals": [0.0, 0.1, 0.2, 0.3]},
    ]
    across = pauses_across(requests, at, {session for session, _ in pool_failovers(log)})
    assert across["n"] == 1 and across["p50"] == across["max"] == pytest.approx(120.0)
    assert pauses_across(requests, None, {"a"}) is None
    assert pauses_across(requests, at, set()) == {"n": 0}
