"""The fused stack's joined projections (engine/fused.py rows_joined): views of the loaded module's own weights,
which the loader lays out back to back, and torch.cat wherever they are not."""

from __future__ import annotations

import torch

from tests.qwen3_fixtures import tiny_base  # noqa: F401
from tts_backend.engine.fused import FusedStack, rows_joined
from tts_backend.qwen3.generate import Qwen3TTS


def test_loaded_projections_join_without_a_copy(tiny_base):
    """The loader lays q/k/v and gate/up back to back, so the fused stack's joined weights are views of the
    module's own (no copy, no second copy in memory) and equal what torch.cat gives; tensors elsewhere fall
    back to torch.cat."""
    model = Qwen3TTS.from_pretrained(tiny_base, "cpu", torch.bfloat16, load_codec=False)
    layer = model.talker.model.layers[1]
    a, m = layer.self_attn, layer.mlp
    fused = FusedStack(model.talker.model, compile=False)
    qkv, gate_up = fused.layers[1][1], fused.layers[1][6]
    assert qkv.data_ptr() == a.q_proj.weight.data_ptr() and gate_up.data_ptr() == m.gate_proj.weight.data_ptr()
    assert torch.equal(qkv, torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)))
    assert torch.equal(gate_up, torch.cat((m.gate_proj.weight, m.up_proj.weight)))
    apart = [torch.randn(3, 4), torch.randn(2, 4)]
    joined = rows_joined(*apart)
    assert torch.equal(joined, torch.cat(apart)) and joined.data_ptr() != apart[0].data_ptr()
    reversed_order = rows_joined(a.k_proj.weight, a.q_proj.weight)
    assert torch.equal(reversed_order, torch.cat((a.k_proj.weight, a.q_proj.weight)))
