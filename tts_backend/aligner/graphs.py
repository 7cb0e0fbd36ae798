"""CUDA graphs of the aligner's two passes, one per bucket: a batch is two replays and a handful of copies.

Eagerly, one aligner batch dispatches about two thousand ops from Python (24 encoder and 28 decoder layers),
each a kernel launch; a thread doing that beside the speech engine's waits for the interpreter at each. Captured,
the encoder pass of every (rows, chunks) bucket and the decoder pass of every (rows, length) bucket
(model.Buckets) is one replay, with the interpreter released while it is launched.

Every graph reads its inputs from, and the decoder's from the encoder's output through, static buffers: flat
device tensors of the largest bucket's size, of which each bucket reads its leading part. All graphs share one
memory pool (they never run at once), captured from the largest down so that the smaller reuse its blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from .features import conv_len


class _Static:
    """One flat device buffer; `view(*shape)` is its leading part in that shape (the same memory each time)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.flat = torch.zeros(size, dtype=dtype, device=device)

    def view(self, *shape: int) -> torch.Tensor:
        return self.flat[: int(np.prod(shape))].view(*shape)


class AlignerGraphs:
    def __init__(self, aligner, buckets) -> None:
        cfg = aligner.cfg
        device, dtype = aligner.device, aligner.dtype
        self.aligner = aligner
        self.chunk = cfg.audio.chunk_frames
        self.bins = cfg.audio.num_mel_bins
        self.tokens_per_chunk = conv_len(self.chunk)
        self.hidden = cfg.text.hidden_size  # the encoder's output_dim too (the decoder takes its outputs)
        B, C, S = max(buckets.rows), max(buckets.chunks), max(buckets.lengths)
        self.mel = _Static(B * self.bins * C * self.chunk, dtype, device)
        self.limits = _Static(B * C * 2, torch.long, device)
        self.tokens = _Static(B, torch.long, device)
        self.ids = _Static(B * S, torch.long, device)
        self.placed = _Static(B * S * self.hidden, dtype, device)
        self.encoders: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.decoders: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for rows in sorted(buckets.rows, reverse=True):
                for chunks in sorted(buckets.chunks, reverse=True):
                    self.encoders[rows, chunks] = self._capture(pool, lambda r=rows, c=chunks: aligner.encode(
                        *self._encoder_inputs(r, c)))
                for length in sorted(buckets.lengths, reverse=True):
                    if length < 2 + self.tokens_per_chunk:  # no prompt of this length has room for a chunk's audio
                        continue
                    self.decoders[rows, length] = self._capture(pool, lambda r=rows, s=length: aligner.decode(
                        self.ids.view(r, s), self.placed.view(r, s, self.hidden)))

    def _encoder_inputs(self, rows: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.mel.view(rows, self.bins, chunks * self.chunk), self.limits.view(rows, chunks, 2),
                self.tokens.view(rows))

    @staticmethod
    def _capture(pool, run) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (cuBLAS and cuDNN pick and allocate their kernels' workspaces there),
        # as torch.cuda.graph's documentation asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph, out

    def run(self, batch) -> np.ndarray | None:
        """The batch's classes [B, S], or None when its buckets were not captured (the caller runs it eagerly)."""
        B, C = batch.conv_limits.shape[:2]
        S = batch.ids.shape[1]
        encoder, decoder = self.encoders.get((B, C)), self.decoders.get((B, S))
        if encoder is None or decoder is None:
            return None
        mel, limits, tokens = self._encoder_inputs(B, C)
        mel.copy_(batch.mel)
        limits.copy_(batch.conv_limits)
        tokens.copy_(batch.tokens)
        self.ids.view(B, S).copy_(batch.ids)
        graph, audio = encoder
        graph.replay()
        # Audio output i is prompt position 1 + i; what the buffer holds elsewhere is never read (decode takes an
        # audio embedding only where the ids hold <|audio_pad|>).
        self.placed.view(B, S, self.hidden)[:, 1 : 1 + audio.shape[1]].copy_(audio)
        graph, classes = decoder
        graph.replay()
        return classes.cpu().numpy()
