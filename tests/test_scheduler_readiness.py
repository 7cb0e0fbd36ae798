"""What the scheduler keeps between decisions (`_Readiness`: which slot holders can step, their deadline order,
the codec items in fill order, the prefill items, each holder's limits) equals, at every decision, what reading
every slot holder from scratch gives. tests/test_scheduler_equivalence.py holds the decisions to the reference
scheduler's; this holds the kept state itself, so a drift that no decision has shown yet fails here too.

The workloads are those of the equivalence tests: random ones through the real engine and the scripted runner
(text pushed while spoken, cancels, back-pressure, an asynchronous codec one or two batches deep, clock jumps),
and bench/engine_sim.py's loaded engine with mid-frame admission on.
"""

from __future__ import annotations

import pytest

from tests.test_scheduler_equivalence import scripted_workload
from tts_backend.engine import engine as engine_module
from tts_backend.engine import scheduler as scheduler_module
from tts_backend.engine.scheduler import _codec_key, _Readiness


def kept_state(readiness: _Readiness) -> dict:
    """Everything a decision reads from `readiness`, by request id."""
    holders = readiness.holders.values()
    return {
        "stepping": [r.request_id for r in readiness.stepping()],
        "by_deadline": [(deadline, holder.request.request_id) for deadline, _, holder in readiness.by_deadline],
        "fresh": sorted(holder.request.request_id for holder in readiness.fresh),
        "codec": [(it.request.request_id, it.frames, it.deadline) for it in readiness.codec_items],
        "prefill": [(it.request.request_id, it.deadline) for it in readiness.prefill_items()],
        "limits": {h.request.request_id: (h.generated_limit, h.fed_limit) for h in holders if h.stepping},
        "paused": sorted(h.request.request_id for h in holders if h.paused),
    }


class CheckedReadiness(_Readiness):
    """Readiness that, each time a decision brings it up to date, compares itself with one built from scratch
    over the same slot holders (admitted in the same order, every one read once)."""

    checks = 0

    def catch_up(self) -> None:
        super().catch_up()
        scratch = _Readiness(self.config)
        for holder in self.holders.values():
            scratch.admit(holder.request)
        scratch.catch_up()
        assert kept_state(self) == kept_state(scratch)
        assert self.codec_keys == sorted(self.codec_keys)
        assert self.codec_keys == [_codec_key(it) for it in self.codec_items]
        assert self.codec_items == [h.codec for h in sorted(self.holders.values(), key=lambda h: h.codec_key or ())
                                    if h.codec is not None]
        CheckedReadiness.checks += 1


class CheckedScheduler(scheduler_module.Scheduler):
    def __init__(self, config=None) -> None:
        super().__init__(config)
        self._readiness = CheckedReadiness(self.config)


def run_checked(monkeypatch, workload) -> int:
    CheckedReadiness.checks = 0
    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "Scheduler", CheckedScheduler)
        workload()
    return CheckedReadiness.checks


@pytest.mark.parametrize("seed", range(12))
def test_kept_readiness_equals_a_reading_from_scratch_under_random_engine_workloads(monkeypatch, seed):
    assert run_checked(monkeypatch, scripted_workload(seed)) > 500


@pytest.mark.parametrize("agent", [False, True], ids=["arrivals", "agent-text"])
def test_kept_readiness_equals_a_reading_from_scratch_in_the_simulated_loaded_engine(monkeypatch, agent):
    pytest.importorskip("torch")  # the simulator's runner module imports torch
    from bench.engine_sim import SimOptions, run_rate

    options = SimOptions(warmup=2.0, duration=4.0, seed=5, host_factor=0.0, agent_sentences=3 if agent else 0)
    assert run_checked(monkeypatch, lambda: run_rate(10.0 if agent else 80.0, options)) > 1000
