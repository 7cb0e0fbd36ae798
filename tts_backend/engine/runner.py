"""The model runner: executes one batch of one kind of work on the device.

The engine thread is the only caller. A runner keeps its per-request device state (KV caches, last hidden
state, sampled codes, codec streaming state, sampler state) in preallocated buffers indexed by the
request's slot, so a batch is just a list of slots.
"""

from __future__ import annotations

import abc

import numpy as np

from .request import RequestState


class ModelRunner(abc.ABC):
    sample_rate: int = 24000
    samples_per_frame: int = 1920
    max_slots: int = 64

    def prepare(self) -> None:
        """Allocate, capture and warm up. Called once on the engine thread before it takes work."""

    @abc.abstractmethod
    def prefill(self, requests: list[RequestState]) -> None:
        """Run each request's prompt; afterwards each has codebook 0 of its first frame sampled."""

    @abc.abstractmethod
    def code_predict(self, requests: list[RequestState]) -> None:
        """Complete the current frame of each request (codebooks 1..15) and append it to its frames."""

    @abc.abstractmethod
    def decode(self, requests: list[RequestState]) -> list[bool]:
        """One Talker step for each request; returns, per request, whether it sampled EOS."""

    @abc.abstractmethod
    def codec(self, requests: list[RequestState], frames: int) -> list[np.ndarray]:
        """Decode the next `frames` frames of each request; float32 PCM in [-1, 1], one array per request."""

    def release(self, request: RequestState) -> None:
        """The request left the engine (done or cancelled); its slot may be reused at once."""
