"""bench/codec_profile.py (GPU only) on the CPU: it parses, refuses to run without CUDA, times the fused
convolution stages beside the unfused ones, and its deviation measure (the SNR of one codec's streamed output
against another's, same weights) tells the fused codec's rounding from a different decode."""

from __future__ import annotations

import math

import pytest
import torch

from bench import codec_profile
from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tts_backend.engine.codec_channels_last import route_codec_convolutions_channels_last
from tts_backend.engine.fused import _route_codec_convolutions, _route_codec_layers


def test_without_cuda_it_stops_before_building_anything(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would run")
    assert codec_profile.main(["--output", str(tmp_path / "out.json")]) == 2
    assert "needs CUDA" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


def test_the_variants_time_the_fused_convolutions_beside_the_unfused():
    assert {name: fused for name, (_, _, fused, _) in codec_profile.VARIANTS.items()} == {
        "fp32": False, "fp32_bench": False, "bf16": False, "fp32_fused": True, "bf16_fused": True,
        "bf16_fused_heuristic": True, "bf16_fused_nlc": True, "bf16_fused_nlc_heuristic": True}
    assert codec_profile.VARIANTS["bf16_fused"][0] is torch.bfloat16
    # The runner's own case (no benchmark mode unless codec_cudnn_benchmark) beside the benchmarked one.
    assert codec_profile.VARIANTS["bf16_fused_heuristic"] == (torch.bfloat16, False, True, False)


def test_the_channels_last_variants_pair_as_the_fused_ones_do():
    """bf16_fused_nlc is bf16_fused with channels-last stages, its heuristic twin likewise, and both fused
    bf16 layouts have their kernels profiled in the same call."""
    variants = codec_profile.VARIANTS
    assert [name for name, (*_, channels_last) in variants.items() if channels_last] == [
        "bf16_fused_nlc", "bf16_fused_nlc_heuristic"]
    for nlc, blocked in (("bf16_fused_nlc", "bf16_fused"), ("bf16_fused_nlc_heuristic", "bf16_fused_heuristic")):
        assert variants[nlc][:3] == variants[blocked][:3]
    assert codec_profile.PROFILED == ("bf16_fused", "bf16_fused_nlc")


def test_build_hands_channels_last_to_the_fast_path():
    """build's channels_last reaches fuse_codec_activations, which refuses it without the fused convolutions
    (before routing anything, so even uncompiled)."""
    with pytest.raises(ValueError, match="needs convolutions"):
        codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny", channels_last=True)
    codec = codec_profile.build(torch.float32, compile=False, convolutions=True, device="cpu", size="tiny",
                                channels_last=True)
    assert "forward" in codec.quantizer.__dict__


def test_deviation_of_the_fused_stages_is_rounding_only():
    plain = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    fused = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    assert _route_codec_layers(fused, compile=False) and _route_codec_convolutions(fused, compile=False)
    assert math.isinf(codec_profile.deviation(plain, plain, batch=2, chunks=3))
    assert codec_profile.deviation(plain, fused, batch=2, chunks=3) > 100  # fp32 rounding: ~1e-7 relative
    nlc = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    assert _route_codec_layers(nlc, compile=False) and route_codec_convolutions_channels_last(nlc, compile=False)
    assert codec_profile.deviation(plain, nlc, batch=2, chunks=3) > 100
    other = codec_profile.build(torch.float32, compile=False, device="cpu", size="tiny")
    with torch.no_grad():
        other.decoder[1].block[0].alpha.add_(0.5)  # another codec: the measure must see it
    assert codec_profile.deviation(plain, other, batch=2, chunks=3) < 80
