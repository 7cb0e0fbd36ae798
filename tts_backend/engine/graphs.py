"""Capture and replay of the runner's steady-state steps as CUDA graphs.

A step is a function of a few small index tensors (slots, prompt ids) that reads and writes only the
runner's persistent per-slot buffers. Capturing it once per shape turns hundreds of kernel launches into
one replay. Graphs that run one at a time on one stream share one memory pool: the temporaries of one
replay are dead before the next starts, and a step's results always land in the persistent buffers, never
in graph-owned memory. A kind of step that replays on a stream of its own, concurrently with the others
(the runner's codec stream), gets a pool of its own (`own_pools`), or two concurrent replays would write
each other's temporaries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence

import torch

log = logging.getLogger(__name__)


class CapturedStep:
    def __init__(self, graph: torch.cuda.CUDAGraph, static_inputs: Sequence[torch.Tensor]) -> None:
        self.graph = graph
        self.static_inputs = static_inputs

    def replay(self, inputs: Sequence[torch.Tensor]) -> None:
        for static, value in zip(self.static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        self.graph.replay()


class GraphSet:
    """Captured steps by key; `run` replays a captured one or runs the step eagerly."""

    def __init__(self, device: torch.device, enabled: bool, own_pools: Sequence[str] = ()) -> None:
        """`own_pools`: kinds of step (the first element of a key) whose graphs get a memory pool apart from
        the shared one, because they replay concurrently with the others."""
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._steps: dict[Hashable, CapturedStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._own_pools = {kind: torch.cuda.graph_pool_handle() for kind in own_pools} if self.enabled else {}
        self.capture_seconds = 0.0
        self.replays = 0
        self.eager_runs = 0
        # Passes run uncaptured while graphs are on, by kind (a key's first element): no captured shape fit
        # them, so each was the host launching every kernel the graphs exist to spare it. The runner counts its
        # own fallbacks that bypass `run` here too (ran_uncaptured).
        self.uncaptured: dict[str, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def capture(self, key: Hashable, fn: Callable[..., None], example_inputs: Sequence[torch.Tensor],
                warmup: int = 2) -> None:
        """Record `fn(*inputs)` for inputs shaped like `example_inputs` (which must be safe to run: index
        tensors pointing at the scratch slot)."""
        if not self.enabled:
            return
        started = time.perf_counter()
        static_inputs = [t.clone() for t in example_inputs]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn(*static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        kind = key[0] if isinstance(key, tuple) and key else None
        with torch.cuda.graph(graph, pool=self._own_pools.get(kind, self._pool)):
            fn(*static_inputs)
        # One replay now, on the example inputs the warm-up runs used: a graph's first launch also uploads it
        # to the device (cudaGraphUpload does that ahead; torch.cuda.CUDAGraph has no call for it), on the host
        # thread that launches it. A shape first needed in service paid that there, and a failover's survivor
        # meets its larger batch, the resume pass and the codec's priming shapes all at once (H100,
        # bench/resume_cost.py: 4 streams resumed in 33 ms the first time, 12 ms the next; in a kill run 7
        # streams paused 101 ms, 54 of them in the survivor's first resume call).
        graph.replay()
        torch.cuda.synchronize(self.device)
        self._steps[key] = CapturedStep(graph, static_inputs)
        self.capture_seconds += time.perf_counter() - started

    def discard(self, kind: str) -> None:
        """Forget the captured steps whose key starts with `kind` (to capture them again another way)."""
        for key in [k for k in self._steps if isinstance(k, tuple) and k and k[0] == kind]:
            del self._steps[key]

    def ran_uncaptured(self, kind: str) -> None:
        """A pass of `kind` ran uncaptured (counted while graphs are on: elsewhere every pass is)."""
        if self.enabled:
            self.uncaptured[kind] = self.uncaptured.get(kind, 0) + 1

    def run(self, key: Hashable, fn: Callable[..., None], inputs: Sequence[torch.Tensor]) -> None:
        step = self._steps.get(key)
        if step is None:
            self.eager_runs += 1
            self.ran_uncaptured(key[0] if isinstance(key, tuple) and key else str(key))
            fn(*inputs)
        else:
            self.replays += 1
            step.replay(inputs)
