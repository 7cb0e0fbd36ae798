"""Start-up check that the Triton fast path computes what the layers compute, on this device.

The kernels are tested in CI under Triton's CPU interpreter (fp32) and were measured on one GPU model. On
another GPU, driver or Triton release a miscompiled kernel would not fail: it would speak noise. So before
capturing its graphs the runner runs the first layer of each stack through the kernels and through the
plain layer function (`fused.make_layer_fn`, eager) on random activations and random cached keys and
values, and the predictor's step tail (norm + lm-head, then the draw) against the compiled path's pieces.
A disagreement far beyond rounding turns that piece of the fast path off (the runner falls back and logs
why); agreement costs a few milliseconds of start-up.

Errors are relative to what the piece computes (a layer's update to the residual stream, the logits), so a
layer whose residual input dominates its output cannot hide a wrong update; the residual input is small
(the layer normalises it, so the update does not shrink with it) to keep the output's own rounding below
the update's. Both sides round to the activation dtype at the same places, so their bf16 disagreement is
bf16 noise: the layer function in bf16 against fp32 is 0.9% of the update on the 1.7B shapes (random
weights, CPU), and on the H200 all 28 Talker layers on the kernels ended within 2.7% (relative norm) of the
modules in bf16, the 5 predictor layers within 0.9% (bench/results/engine_step_h200_triton.json). The limits below are an order of magnitude above that and below what a broken kernel
produces (an attention output off by half: 40-60% of the update; a wrong draw: most codes differ).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fused import FusedCodePredictor, FusedStack, _rms_norm, make_layer_fn, residual_sampler

LAYER_LIMIT = 0.15  # max |kernel - layer function| / max |layer update|
LOGITS_LIMIT = 0.05  # max |kernel - reference| / max |reference logits|
DRAW_AGREEMENT = 0.9  # share of rows whose drawn code matches the compiled sampler's (ties may differ)
CHECK_ROWS = 8
TALKER_POSITIONS = 160  # spans several of the attention kernel's position blocks


@dataclass
class KernelCheck:
    """Measured disagreements; `layers_ok` and `tail_ok` say which parts of the fast path may serve."""

    talker_layer: float
    predictor_layer: float
    predictor_paired: float
    tail_logits: float = 0.0
    tail_draws: float = 1.0  # share of agreeing draws
    tail_checked: bool = False

    @property
    def layers_ok(self) -> bool:
        return max(self.talker_layer, self.predictor_layer, self.predictor_paired) <= LAYER_LIMIT

    @property
    def tail_ok(self) -> bool:
        return not self.tail_checked or (self.tail_logits <= LOGITS_LIMIT and self.tail_draws >= DRAW_AGREEMENT)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "layers_ok": self.layers_ok, "tail_ok": self.tail_ok}


def _relative(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    error = (got.float() - want.float()).abs().max().item()
    size = scale.float().abs().max().item()
    if error != error or size != size:  # NaN on either side is a failure, never a pass
        return float("inf")
    return error / max(size, 1e-12)


def layer_disagreement(stack: FusedStack, cfg, cache_len: int, positions: int, rows: int, paired: bool,
                       seed: int) -> float:
    """Layer 0 of `stack` through the kernels vs the layer function, `rows` rows at random positions below
    `positions` (paired: each row's positions p and p + 1 in one launch, as the predictor's first step).
    The caches are as long as the runner's (`cache_len`), so the check runs the kernels compiled for serving
    rather than compiling variants of its own."""
    weights = stack.layers[0]
    device, dtype = weights[0].device, weights[0].dtype
    generator = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    kv, head_dim = cfg.num_key_value_heads, cfg.head_dim
    k_cache, v_cache = randn(rows, kv, cache_len, head_dim), randn(rows, kv, cache_len, head_dim)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.arange(rows, device=device)
    span = 2 if paired else 1
    pos = torch.randint(0, positions - span + 1, (rows,), generator=generator).to(device)
    pos[0] = 0  # the first position attends to itself only
    x = randn(rows, span, cfg.hidden_size) * 0.05
    layer_fn = make_layer_fn(cfg.num_attention_heads, kv, head_dim, cfg.rms_norm_eps, cfg.rope_theta)
    ref_pos = pos[:, None] + torch.arange(span, device=device)[None]
    want = layer_fn(x, *weights, k_ref, v_ref, slots, ref_pos, torch.arange(cache_len, device=device))
    if paired:
        got = stack.kernels.decode_layer(torch.cat((x[:, 0], x[:, 1])), weights, k_cache, v_cache,
                                         torch.cat((slots, slots)), torch.cat((pos, pos + 1)), stack.num_heads,
                                         stack.eps, stack.theta, pair_offset=rows)
        got = torch.stack((got[:rows], got[rows:]), dim=1)
    else:
        got = stack.kernels.decode_layer(x[:, 0], weights, k_cache, v_cache, slots, pos, stack.num_heads,
                                         stack.eps, stack.theta)[:, None]
    return _relative(got, want, want - x)


def tail_disagreement(fused_cp: FusedCodePredictor, rows: int, seed: int) -> tuple[float, float]:
    """The predictor's step tail: (norm + lm-head logits error, share of draws equal to the compiled
    sampler's on the same logits, seeds and counters; the next input must be the table row of the code)."""
    stack, kernels, params = fused_cp.stack, fused_cp.stack.kernels, fused_cp.params
    norm_weight, head, table = stack.norm_weight, fused_cp.heads[0], fused_cp.next_tables[0]
    device, dtype = head.device, head.dtype
    generator = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(rows, head.shape[1], generator=generator).to(device=device, dtype=dtype)
    want_logits = F.linear(_rms_norm(h, norm_weight, stack.eps), head)
    got_logits = kernels.norm_matmul(h, norm_weight, head, stack.eps)
    logits_error = _relative(got_logits, want_logits, want_logits)
    seeds = torch.randint(0, 2**31 - 1, (rows,), generator=generator).to(device)
    counters = torch.randint(0, 10_000, (rows,), generator=generator).to(device)
    if params.subtalker_do_sample:
        # Eager: the tail replaces the compiled sampler, so compiling it only for this check would be waste.
        want = residual_sampler(params, compile=False)(want_logits, seeds, counters)
    else:
        want = torch.argmax(want_logits.float(), dim=-1)
    codes = torch.empty(rows, dtype=torch.long, device=device)
    next_input = kernels.sample_rows(want_logits, seeds, counters, 0, codes, params.subtalker_temperature,
                                     params.subtalker_top_k, params.subtalker_do_sample, table)
    agree = (codes == want).float().mean().item()
    if not torch.equal(next_input, table[codes]):
        agree = 0.0
    return logits_error, agree


@torch.inference_mode()
def check_triton_path(fused_talker: FusedStack, talker_cfg, fused_cp: FusedCodePredictor, max_len: int,
                      seed: int = 0) -> KernelCheck:
    """Layer 0 of the Talker (unpaired) and of the predictor (unpaired and paired), then the predictor's
    step tail when it is in use. `max_len`: the Talker cache length the runner serves with."""
    predictor_cfg = talker_cfg.code_predictor
    groups = fused_cp.positions.shape[0]
    check = KernelCheck(
        talker_layer=layer_disagreement(fused_talker, talker_cfg, max_len, min(max_len, TALKER_POSITIONS),
                                        CHECK_ROWS, paired=False, seed=seed),
        predictor_layer=layer_disagreement(fused_cp.stack, predictor_cfg, groups, groups, CHECK_ROWS,
                                           paired=False, seed=seed + 1),
        predictor_paired=layer_disagreement(fused_cp.stack, predictor_cfg, groups, groups, CHECK_ROWS,
                                            paired=True, seed=seed + 2),
    )
    if fused_cp.fused_tail:
        check.tail_logits, check.tail_draws = tail_disagreement(fused_cp, 4 * CHECK_ROWS, seed + 3)
        check.tail_checked = True
    return check
