"""The codec's fast path (engine/fused.py) decodes what the codec modules decode, chunk by chunk.

On the CPU the routed functions run eagerly (compile=False); on CUDA the engine compiles the same functions.
"""

from __future__ import annotations

import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tests.test_qwen3_codec import decode_in_chunks, random_codes, schedule
from tts_backend.engine.fused import _route_codec_layers, fuse_codec_activations, unfuse_codec_activations
from tts_backend.qwen3.loader import load_codec_decoder
from tts_backend.qwen3.testing.codec_checkpoint import write_speech_tokenizer


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec_fast")
    # GQA (4 query heads over 2 K/V heads) and a short window, so the routed attention and its history matter.
    write_speech_tokenizer(root, "tiny", seed=5, decoder_overrides={"sliding_window": 5, "num_key_value_heads": 2})
    return load_codec_decoder(root)


def test_fast_path_equals_the_modules_in_chunks(decoder):
    codes = random_codes(3, 23, decoder.config, seed=2)
    sizes = schedule([2, 4, 8, 12], 23)
    plain = decode_in_chunks(decoder, codes, sizes)
    try:
        routed = fuse_codec_activations(decoder, compile=False) + _route_codec_layers(decoder, compile=False)
        assert routed == 1 + decoder.config.num_hidden_layers
        assert "forward" in decoder.quantizer.__dict__
        fast = decode_in_chunks(decoder, codes, sizes)
    finally:
        unfuse_codec_activations(decoder)
    assert "forward" not in decoder.quantizer.__dict__
    assert fast.shape == plain.shape
    assert (fast - plain).abs().max().item() <= 1e-5
    again = decode_in_chunks(decoder, codes, sizes)  # undone: the modules' own forwards again
    assert torch.equal(again, plain)


def test_routed_layers_keep_the_sliding_window_history(decoder):
    """Decoding 1 frame at a time (history carries everything) equals one whole decode, on the fast path."""
    codes = random_codes(2, 14, decoder.config, seed=9)
    whole = decode_in_chunks(decoder, codes, [14])
    try:
        fuse_codec_activations(decoder, compile=False)
        _route_codec_layers(decoder, compile=False)
        stepwise = decode_in_chunks(decoder, codes, [1] * 14)
    finally:
        unfuse_codec_activations(decoder)
    assert (stepwise - whole).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_routed_functions_trace_whole_under_dynamo(tmp_path, kv_heads, monkeypatch):
    """What CUDA compiles with Inductor must trace as one graph with dynamic shapes (fullgraph): checked here
    with the aot_eager backend, which needs no compiler, on both attention layouts (GQA and plain)."""
    write_speech_tokenizer(tmp_path, "tiny", seed=6, decoder_overrides={"sliding_window": 5,
                                                                        "num_key_value_heads": kv_heads})
    decoder = load_codec_decoder(tmp_path)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "aot_eager"}))
    codes = random_codes(2, 9, decoder.config, seed=1)
    plain = decode_in_chunks(decoder, codes, [2, 3, 4])
    torch._dynamo.reset()
    try:
        fuse_codec_activations(decoder, compile=True)
        fast = decode_in_chunks(decoder, codes, [2, 3, 4])
        fast_again = decode_in_chunks(decoder, codes, [1, 4, 4])  # other shapes: recompiles, never breaks
    finally:
        unfuse_codec_activations(decoder)
        torch._dynamo.reset()
    assert (fast - plain).abs().max().item() <= 1e-5
    assert (fast_again - plain).abs().max().item() <= 1e-5
