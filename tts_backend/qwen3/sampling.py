"""The logits pipeline of the published generation config, step for step as the reference runs it (spec §5.8).

Talker (codebook 0), on fp32 logits of the last position:
  repetition penalty over this utterance's previous codebook-0 tokens -> EOS blocked until `min_new_tokens`
  tokens exist -> ids [vocab-1024, vocab) except EOS suppressed -> temperature -> top-k -> top-p -> softmax ->
  multinomial (or argmax when greedy: then only the first three steps apply).
Code predictor (codebooks 1..15): temperature -> top-k -> top-p -> softmax -> multinomial (or argmax).

Random numbers: one draw per sampled token in the order c0 (after prefill), then per frame c1..c15 followed by
the next c0 — the same order as the reference, so a `torch.Generator` seeded like `torch.manual_seed(seed)`
reproduces its sampled codes. A batch shares one generator (one multinomial call over all rows, as the reference
does) or gives each row its own (what a serving engine wants: a request's audio then never depends on its
neighbours).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .config import GenerationConfig, TalkerConfig

Generators = torch.Generator | Sequence[torch.Generator | None] | None


@dataclass(frozen=True)
class SamplingParams:
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048
    min_new_tokens: int = 2

    @classmethod
    def from_generation_config(cls, gen: GenerationConfig, **overrides) -> "SamplingParams":
        params = cls(
            do_sample=gen.do_sample, temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
            repetition_penalty=gen.repetition_penalty, subtalker_do_sample=gen.subtalker_dosample,
            subtalker_temperature=gen.subtalker_temperature, subtalker_top_k=gen.subtalker_top_k,
            subtalker_top_p=gen.subtalker_top_p, max_new_tokens=gen.max_new_tokens,
        )
        return replace(params, **{k: v for k, v in overrides.items() if v is not None})

    def greedy(self) -> "SamplingParams":
        return replace(self, do_sample=False, subtalker_do_sample=False)


def apply_repetition_penalty(scores: torch.Tensor, history: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """scores [B, V] fp32; history [B, n] previously generated ids (n may be 0)."""
    if penalty == 1.0 or history is None or history.shape[1] == 0:
        return scores
    picked = torch.gather(scores, 1, history)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return scores.scatter(1, history, picked)


def suppression_mask(cfg: TalkerConfig, device: torch.device | str) -> torch.Tensor:
    """[V] bool: the special range [vocab-1024, vocab) except EOS — ids the talker must never emit."""
    ids = torch.arange(cfg.vocab_size, device=device)
    mask = ids >= cfg.vocab_size - 1024
    mask[cfg.codec_eos_token_id] = False
    return mask


def warp(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature -> top-k -> top-p on [B, V] fp32 scores (identity steps skipped like the reference)."""
    if temperature != 1.0:
        scores = scores / temperature
    if top_k and top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def draw(scores: torch.Tensor, do_sample: bool, generators: Generators) -> torch.Tensor:
    """[B, V] processed scores -> ids [B]: argmax, or softmax + multinomial with the given generator(s)."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if generators is None or isinstance(generators, torch.Generator):
        return torch.multinomial(probs, num_samples=1, generator=generators).squeeze(1)
    rows = [
        torch.multinomial(probs[i : i + 1], num_samples=1, generator=g).squeeze(1)
        for i, g in enumerate(generators)
    ]
    return torch.cat(rows)


def talker_scores(
    logits: torch.Tensor,  # [B, V] fp32
    history: torch.Tensor | None,  # [B, n] codebook-0 ids generated so far in this utterance
    num_generated: int | torch.Tensor,  # tokens generated so far (int, or [B] per row)
    params: SamplingParams,
    eos_id: int,
    suppress: torch.Tensor,  # [V] bool from suppression_mask
) -> torch.Tensor:
    scores = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if isinstance(num_generated, int):
        if num_generated < params.min_new_tokens:
            scores = scores.clone()
            scores[:, eos_id] = float("-inf")
    else:
        block = num_generated < params.min_new_tokens  # [B]
        scores = scores.clone()
        scores[:, eos_id] = torch.where(block, torch.full_like(scores[:, eos_id], float("-inf")), scores[:, eos_id])
    scores = scores.masked_fill(suppress, float("-inf"))
    if params.do_sample:
        scores = warp(scores, params.temperature, params.top_k, params.top_p)
    return scores


def sample_talker(
    logits: torch.Tensor, history: torch.Tensor | None, num_generated: int | torch.Tensor,
    params: SamplingParams, eos_id: int, suppress: torch.Tensor, generators: Generators,
) -> torch.Tensor:
    """fp32 talker logits [B, V] -> codebook-0 ids [B]."""
    scores = talker_scores(logits, history, num_generated, params, eos_id, suppress)
    return draw(scores, params.do_sample, generators)


def sample_residual(logits: torch.Tensor, params: SamplingParams, generators: Generators) -> torch.Tensor:
    """fp32 code-predictor logits [B, V] -> ids [B]."""
    scores = logits.float()
    if params.subtalker_do_sample:
        scores = warp(scores, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
    return draw(scores, params.subtalker_do_sample, generators)
