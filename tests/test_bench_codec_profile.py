"""bench/codec_profile.py (GPU only) on the CPU: it parses, refuses to run without CUDA, times the fused
convolution stages beside the unfused ones, and its deviation measure (the SNR of one codec's streamed output
against another's, same weights) tells the fused codec's rounding from a different decode."""

from __future__ import annotations

import math

import pytest
import torch

from bench import codec_profile
from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tts_backend.engine.fused import _route_codec_convolutions, _route_codec_layers


def test_without_cuda_it_stops_before_building_anything(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would run")
    assert codec_profile.main(["--output", str(tmp_path / "out.json")]) == 2
    assert "needs CUDA" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


def test_the_variants_time_the_fused_convolutions_beside_the_unfused():
    assert {name: fused for name, (_, _, fused) in codec_profile.VARIANTS.items()} == {
        "fp32": False, "fp32_bench": False, "bf16": False, "fp32_fused": True, "bf16_fused": True,
        "bf16_fused_heuristic": True}
    assert codec_profile.VARIANTS["bf16_fused"][0] is torch.bfloat16
    # The runner's own case (no benchmark mode unless codec_cudnn_benchmark) beside the benchmarked one.
    assert codec_profile.VARIANTS["bf16_fused_heuristic"] == (torch.bfloat16, False, True)


def test_deviation_of_the_fused_stages_is_rounding_only():
    plain = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    fused = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    assert _route_codec_layers(fused, compile=False) and _route_codec_convolutions(fused, compile=False)
    assert math.isinf(codec_profile.deviation(plain, plain, batch=2, chunks=3))
    assert codec_profile.deviation(plain, fused, batch=2, chunks=3) > 100  # fp32 rounding: ~1e-7 relative
    other = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    with torch.no_grad():
        other.decoder[1].block[0].alpha.add_(0.5)  # another codec: the measure must see it
    assert codec_profile.deviation(plain, other, batch=2, chunks=3) < 80
