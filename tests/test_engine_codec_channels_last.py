"""The codec's channels-last fused stages (engine/codec_channels_last.py) decode what the codec modules decode,
chunk by chunk and row by row, and hand cuDNN only channels-last 4-D tensors.

On the CPU the routed functions run eagerly (compile=False); on CUDA the engine compiles the same functions.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

from bench.codec_profile import snr_db
from bench.engine_load import engine_options
from tests.qwen3_fixtures import single_torch_thread, tiny_custom_voice  # noqa: F401 - fixtures
from tests.test_engine_codec_fast import assert_rows_decode_as_the_modules, decode_rows, route_fast_path
from tests.test_qwen3_codec import decode_in_chunks, random_codes
from tts_backend.engine.codec_fast import fuse_codec_activations
from tts_backend.engine.fused import unfuse_codec_activations
from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
from tts_backend.qwen3.loader import load_codec_decoder
from tts_backend.qwen3.testing.codec_checkpoint import write_speech_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec_channels_last")
    write_speech_tokenizer(root, "tiny", seed=5, decoder_overrides={"sliding_window": 5, "num_key_value_heads": 2})
    return root


@pytest.fixture(scope="module")
def decoder(checkpoint):
    return load_codec_decoder(checkpoint)


def test_channels_last_keeps_every_history_row_by_row_fp32(decoder):
    """The engine's pool (streams at different positions gathered into each call and scattered back): every
    output and every history tensor where the modules leave them, in the state's own [B, C, H] layout."""
    plain_pool = assert_rows_decode_as_the_modules(decoder, functools.partial(route_fast_path, channels_last=True))
    assert plain_pool.tensors["decoder.0"].abs().max() > 0  # the first conv's history (routed here only)


def test_channels_last_keeps_every_history_row_by_row_bf16(checkpoint):
    """In bfloat16 each path rounds its own intermediate tensors (here the final conv, a oneDNN 2-D conv
    instead of a 1-D one, rounds its output differently), so the measure is an SNR: the channels-last path's
    outputs and histories are the [B, C, T] fused path's to bf16 rounding (over 40 and 35 dB; a wrong bias or
    a history off by a row is under 30), and its output is as close to the fp32 modules' as the fused path's."""
    codes = random_codes(4, 40, load_codec_decoder(checkpoint).config, seed=4)
    reference, _ = decode_rows(load_codec_decoder(checkpoint), codes)
    decoder = load_codec_decoder(checkpoint).to(torch.bfloat16)
    try:
        route_fast_path(decoder)
        fused_out, fused_pool = decode_rows(decoder, codes)
        unfuse_codec_activations(decoder)
        route_fast_path(decoder, channels_last=True)
        fast_out, fast_pool = decode_rows(decoder, codes)
    finally:
        unfuse_codec_activations(decoder)
    assert [o.shape for o in fast_out] == [o.shape for o in fused_out]
    assert all(o.dtype == torch.bfloat16 for o in fast_out)
    reference, fused, fast = (torch.cat([o.flatten() for o in outputs]) for outputs in (reference, fused_out, fast_out))
    assert snr_db(fused, fast) > 40
    assert snr_db(reference, fast) >= snr_db(reference, fused) - 0.5
    for key, tensor in fused_pool.tensors.items():
        assert snr_db(tensor, fast_pool.tensors[key]) > 35, key


def test_the_convolutions_get_channels_last_4d_tensors(decoder, monkeypatch):
    """Every routed convolution is a 2-D one whose input, weight and output are channels-last in memory (so
    cuDNN's NHWC kernels need no transform): a 3-D or NCHW-contiguous tensor fails here. The weights are the
    ones converted at routing (the same storage every call); only the pre-conv, before the pre-transformer
    and not routed, still runs as a 1-D conv."""
    calls, weights = [], {}

    def channels_last_only(t: torch.Tensor) -> bool:
        # One channel (a depthwise weight, the final conv's output) or one position: both layouts are the
        # same memory, so NCHW-contiguous is channels-last too.
        same_memory = t.shape[1] == 1 or t.shape[2] * t.shape[3] == 1
        return t.is_contiguous(memory_format=torch.channels_last) and (same_memory or not t.is_contiguous())

    def spy(name, real):
        def conv(x, weight, *args, **kwargs):
            out = real(x, weight, *args, **kwargs)
            calls.append(name)
            for tensor in (x, weight, out):
                assert tensor.dim() == 4 and channels_last_only(tensor), (name, tensor.shape, tensor.stride())
            assert x.shape[1] > 1 and x.shape[3] > 1  # inputs where the layouts differ: the check means something
            weights.setdefault(weight.data_ptr(), 0)
            weights[weight.data_ptr()] += 1
            return out
        return conv

    one_d = []
    monkeypatch.setattr(F, "conv2d", spy("conv2d", F.conv2d))
    monkeypatch.setattr(F, "conv_transpose2d", spy("conv_transpose2d", F.conv_transpose2d))
    real_conv1d, real_transpose1d = F.conv1d, F.conv_transpose1d
    monkeypatch.setattr(F, "conv1d", lambda *a, **k: one_d.append("conv1d") or real_conv1d(*a, **k))
    monkeypatch.setattr(F, "conv_transpose1d", lambda *a, **k: one_d.append("t") or real_transpose1d(*a, **k))
    codes = random_codes(2, 6, decoder.config, seed=8)
    try:
        route_fast_path(decoder, channels_last=True)
        decode_in_chunks(decoder, codes, [2, 4])
    finally:
        unfuse_codec_activations(decoder)
    units = 3 * len(decoder.config.upsample_rates)
    per_call = {"conv2d": 2 + 1 + units + 1, "conv_transpose2d": 2 + len(decoder.config.upsample_rates)}
    assert {name: calls.count(name) for name in per_call} == {name: 2 * n for name, n in per_call.items()}
    assert sorted(set(weights.values())) == [2]  # one weight per conv, the same tensor in both calls
    assert one_d == ["conv1d", "conv1d"]  # the pre-conv, once per call


def test_channels_last_needs_the_fused_convolutions(decoder, tiny_custom_voice):
    from tts_backend.qwen3.generate import Qwen3TTS

    with pytest.raises(ValueError, match="needs convolutions"):
        fuse_codec_activations(decoder, compile=True, convolutions=False, channels_last=True)
    assert not any("forward" in m.__dict__ for m in decoder.modules())  # refused before routing anything
    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="needs codec_fused_convolutions"):
        Qwen3ModelRunner(model, Qwen3RunnerConfig(codec_channels_last=True))


def test_the_runner_option_round_trips_through_the_bench_options():
    """`-o runner_options={...}` as the benches pass it to a worker reaches Qwen3RunnerConfig as given."""
    options = engine_options(8, ["runner_options=" + json.dumps({"codec_fused_convolutions": True,
                                                                   "codec_channels_last": True})])
    passed = json.loads(next(o for o in options if o.startswith("runner_options="))[len("runner_options="):])
    config = Qwen3RunnerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in passed.items()})
    assert config.codec_channels_last and config.codec_fused_convolutions


def test_the_fast_codec_is_the_cuda_default_and_stays_off_elsewhere(tiny_custom_voice):
    """"auto" (the default) turns the fused, channels-last stages on for the fused path on CUDA only (on the CPU
    they are off unless asked), channels-last follows the fused stages, and a value that is neither a bool nor
    "auto" is refused by name."""
    from tts_backend.qwen3.generate import Qwen3TTS

    defaults = Qwen3RunnerConfig()
    assert defaults.codec_fused_convolutions == "auto" and defaults.codec_channels_last == "auto"
    assert defaults.codec_cudnn_benchmark is True
    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu", dtype=torch.float32)
    runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=64, fused=True, sampler="stateless"))
    assert runner.fused and not runner.codec_fused_convolutions and not runner.codec_channels_last
    asked = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=64, fused=True, sampler="stateless",
                                                      codec_fused_convolutions=True))
    assert asked.codec_fused_convolutions and asked.codec_channels_last  # "auto" follows the fused stages
    with pytest.raises(ValueError, match="codec_channels_last must be true, false or"):
        Qwen3ModelRunner(model, Qwen3RunnerConfig(codec_channels_last="yes"))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_the_compiled_functions_trace_whole_and_few(tmp_path, kv_heads, monkeypatch):
    """What CUDA compiles with Inductor must trace as one graph with dynamic shapes (fullgraph; the aot_eager
    backend here, which needs no compiler) and as few variants as the [B, C, T] fused path or fewer: over the
    captured frame counts at two batch sizes, the layer 2 (one frame is a size-1 dimension of its own), the
    SnakeBeta-into-window function 2 (a transposed conv's history of 1 input against the final conv's 6), and
    unit_input (ConvNeXt's input too), snake_biased and convnext_hidden 1 each: 7, against the fused path's 8."""
    write_speech_tokenizer(tmp_path, "tiny", seed=6, decoder_overrides={"sliding_window": 5,
                                                                        "num_key_value_heads": kv_heads})
    decoder = load_codec_decoder(tmp_path)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "aot_eager"}))
    plain = {(batch, tuple(sizes)): decode_in_chunks(decoder, random_codes(batch, sum(sizes), decoder.config, 3),
                                                     sizes)
             for batch in (2, 5) for sizes in ([1], [2, 4, 8, 12])}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters outlive reset()
    try:
        with torch.inference_mode():  # as the runner routes it at start-up
            fuse_codec_activations(decoder, compile=True, channels_last=True)
        assert "forward" in decoder.upsample[0][0].__dict__
        for (batch, sizes), expected in plain.items():
            fast = decode_in_chunks(decoder, random_codes(batch, sum(sizes), decoder.config, 3), list(sizes))
            assert (fast - expected).abs().max().item() <= 1e-5
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 + 2 + 3
    finally:
        unfuse_codec_activations(decoder)
        torch._dynamo.reset()


def test_benchmark_mode_and_its_limit_hold_for_the_capture_only(tiny_custom_voice):
    """codec_cudnn_benchmark_limit: how many algorithms cuDNN's benchmark mode times per shape while the codec is
    captured; both settings are the process's again afterwards, and a limit that is not a count is refused."""
    from tts_backend.engine.runner import _cudnn_benchmark
    from tts_backend.qwen3.generate import Qwen3TTS

    before = torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit
    with _cudnn_benchmark(True, 3):
        assert torch.backends.cudnn.benchmark and torch.backends.cudnn.benchmark_limit == 3
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit) == before
    with _cudnn_benchmark(False, 3):  # off: the limit is not touched
        assert torch.backends.cudnn.benchmark_limit == before[1]
    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu", dtype=torch.float32)
    for bad in (-1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="codec_cudnn_benchmark_limit"):
            Qwen3ModelRunner(model, Qwen3RunnerConfig(codec_cudnn_benchmark_limit=bad))
