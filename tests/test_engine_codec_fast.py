"""The codec's fast path (engine/fused.py) decodes what the codec modules decode, chunk by chunk.

On the CPU the routed functions run eagerly (compile=False); on CUDA the engine compiles the same functions.
"""

from __future__ import annotations

import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tests.test_qwen3_codec import decode_in_chunks, random_codes, schedule
from tts_backend.engine.codec_channels_last import route_codec_convolutions_channels_last
from tts_backend.engine.codec_fast import fuse_codec_activations
from tts_backend.engine.fused import _route_codec_convolutions, _route_codec_layers, unfuse_codec_activations
from tts_backend.qwen3.codec import CodecState
from tts_backend.qwen3.loader import load_codec_decoder
from tts_backend.qwen3.testing.codec_checkpoint import write_speech_tokenizer


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec_fast")
    # GQA (4 query heads over 2 K/V heads) and a short window, so the routed attention and its history matter.
    write_speech_tokenizer(root, "tiny", seed=5, decoder_overrides={"sliding_window": 5, "num_key_value_heads": 2})
    return load_codec_decoder(root)


# The routed convolution stages: 2 ConvNeXt blocks, 4 decoder blocks, the final SnakeBeta and conv.
ROUTED_CONVOLUTION_STAGES = 2 + 4 + 2


def route_fast_path(decoder, channels_last: bool = False) -> int:
    """Everything the engine routes on CUDA with codec_fused_convolutions (and with `channels_last`,
    codec_channels_last's [B, T, C] stages), run eagerly (what compile=True compiles)."""
    convolutions = route_codec_convolutions_channels_last if channels_last else _route_codec_convolutions
    return (fuse_codec_activations(decoder, compile=False) + _route_codec_layers(decoder, compile=False)
            + convolutions(decoder, compile=False))


# codec_channels_last also routes the 2 upsampling transposed convs and the decoder's first conv.
ROUTED_CHANNELS_LAST_STAGES = ROUTED_CONVOLUTION_STAGES + 2 + 1


@pytest.mark.parametrize("channels_last", [False, True], ids=["ncl", "nlc"])
def test_fast_path_equals_the_modules_in_chunks(decoder, channels_last):
    codes = random_codes(3, 23, decoder.config, seed=2)
    sizes = schedule([2, 4, 8, 12], 23)
    plain = decode_in_chunks(decoder, codes, sizes)
    stages = ROUTED_CHANNELS_LAST_STAGES if channels_last else ROUTED_CONVOLUTION_STAGES
    try:
        routed = route_fast_path(decoder, channels_last)
        assert routed == 1 + decoder.config.num_hidden_layers + stages
        assert "forward" in decoder.quantizer.__dict__ and "forward" in decoder.decoder[1].__dict__
        if channels_last:
            assert all("forward" in m.__dict__ for m in (decoder.upsample[0][0], decoder.decoder[0]))
        fast = decode_in_chunks(decoder, codes, sizes)
    finally:
        unfuse_codec_activations(decoder)
    assert not any("forward" in m.__dict__ for m in decoder.modules())
    assert fast.shape == plain.shape
    assert (fast - plain).abs().max().item() <= 1e-5
    again = decode_in_chunks(decoder, codes, sizes)  # undone: the modules' own forwards again
    assert torch.equal(again, plain)


def test_routed_layers_keep_the_sliding_window_history(decoder):
    """Decoding 1 frame at a time (history carries everything) equals one whole decode, on the fast path."""
    codes = random_codes(2, 14, decoder.config, seed=9)
    whole = decode_in_chunks(decoder, codes, [14])
    try:
        route_fast_path(decoder)
        stepwise = decode_in_chunks(decoder, codes, [1] * 14)
    finally:
        unfuse_codec_activations(decoder)
    assert (stepwise - whole).abs().max().item() <= 1e-5


def assert_states_close(fast: CodecState, plain: CodecState) -> None:
    assert fast.tensors.keys() == plain.tensors.keys()
    assert torch.equal(fast.positions, plain.positions)
    for key, tensor in plain.tensors.items():
        assert fast.tensors[key].shape == tensor.shape, key
        # Float32 rounding relative to the history's scale (a late stage's values reach tens; the same sums in
        # another order differ in the last bits of those).
        scale = max(1.0, tensor.abs().max().item())
        assert (fast.tensors[key] - tensor).abs().max().item() <= 1e-5 * scale, key


# The engine's use: (rows, frames) per call over a pool of 4 stream rows; fresh rows join streams in mid-flight.
ENGINE_CALLS = [([0, 1], 3), ([1, 0, 2], 1), ([3, 2], 7), ([2, 0, 1, 3], 12), ([1, 3], 2), ([0, 1, 2, 3], 5)]


def decode_rows(decoder, codes: torch.Tensor, calls=ENGINE_CALLS) -> tuple[list[torch.Tensor], CodecState]:
    """Each call gathers its rows of a pool (in any order) into a static state, decodes t frames of each and
    scatters the state back, as the engine does; returns every call's output and the pool."""
    pool, done, outputs = decoder.init_state(codes.shape[0]), [0] * codes.shape[0], []
    with torch.inference_mode():
        for rows, t in calls:
            static = decoder.init_state(len(rows)).copy_rows_from_(pool, rows)
            batch = torch.stack([codes[r, :, done[r]:done[r] + t] for r in rows])
            outputs.append(decoder.decode_chunk(batch, static))
            pool.index_copy_(rows, static)
            for r in rows:
                done[r] += t
    return outputs, pool


def assert_rows_decode_as_the_modules(decoder, route) -> CodecState:
    """With `route(decoder)`'s fast path, every output sample and every history tensor of the engine's pool
    (decode_rows) is where the modules leave it; returns the modules' pool."""
    codes = random_codes(4, 40, decoder.config, seed=4)
    plain_out, plain_pool = decode_rows(decoder, codes)
    try:
        route(decoder)
        fast_out, fast_pool = decode_rows(decoder, codes)
    finally:
        unfuse_codec_activations(decoder)
    for fast, plain in zip(fast_out, plain_out):
        assert fast.shape == plain.shape
        assert (fast - plain).abs().max().item() <= 1e-5
    assert_states_close(fast_pool, plain_pool)
    return plain_pool


def test_fused_convolutions_keep_every_history_row_by_row(decoder):
    plain_pool = assert_rows_decode_as_the_modules(decoder, route_fast_path)
    assert plain_pool.tensors["decoder.4.block.4.conv1"].abs().max() > 0  # the histories were written


def test_convolution_routing_is_optional(decoder):
    """`convolutions=False` is the fast path before the convolution stages were fused (bench/codec_profile.py
    times both); without `compile` neither routes them."""
    try:
        fuse_codec_activations(decoder, compile=False)
        assert "forward" not in decoder.decoder[1].__dict__
    finally:
        unfuse_codec_activations(decoder)


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
        routed = fuse_codec_activations(decoder, compile=True)
        assert routed > 1 + decoder.config.num_hidden_layers + ROUTED_CONVOLUTION_STAGES  # + the SnakeBetas
        assert all("forward" in block.__dict__ for block in decoder.decoder[1:])
        fast = decode_in_chunks(decoder, codes, [2, 3, 4])
        fast_again = decode_in_chunks(decoder, codes, [1, 4, 4])  # other shapes: recompiles, never breaks
    finally:
        unfuse_codec_activations(decoder)
        torch._dynamo.reset()
    assert (fast - plain).abs().max().item() <= 1e-5
    assert (fast_again - plain).abs().max().item() <= 1e-5


def test_the_compiled_codec_traces_few_variants(tmp_path, monkeypatch):
    """Each traced variant is a TorchInductor compile at start-up on CUDA (issue 22), so the routed functions
    must not trace one per frame count or batch: over the captured counts (1, 2, 4, 8, 12 frames) at two
    batch sizes, the layer traces 2 (one frame is a size-1 dimension of its own), the SnakeBeta-into-window
    function 2 (a transposed conv's history of 1 input against the final conv's 6) and the other four 1 each."""
    write_speech_tokenizer(tmp_path, "tiny", seed=6, decoder_overrides={"sliding_window": 5})
    decoder = load_codec_decoder(tmp_path)
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the counters outlive reset()
    try:
        fuse_codec_activations(decoder, compile=True)
        for batch in (2, 5):
            for sizes in ([1], [2, 4, 8, 12]):
                decode_in_chunks(decoder, random_codes(batch, sum(sizes), decoder.config, seed=3), sizes)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 + 2 + 4
    finally:
        unfuse_codec_activations(decoder)
        torch._dynamo.reset()
