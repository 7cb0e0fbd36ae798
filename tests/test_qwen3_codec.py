"""The 12 Hz codec decoder: config, checkpoint layout and loading, and exact state-carrying streaming.

Parity with the reference implementation lives in test_qwen3_codec_reference.py.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tts_backend.qwen3.codec import (
    CodecDecoder,
    CodecDecoderConfig,
    codec_state_dict_from_checkpoint,
    is_ignored_codec_tensor,
)
from tts_backend.qwen3.loader import CheckpointError, load_codec_decoder
from tts_backend.qwen3.testing.codec_checkpoint import (
    FULL_SPEECH_TOKENIZER_CONFIG,
    speech_tokenizer_config,
    speech_tokenizer_tensor_shapes,
    write_speech_tokenizer,
)

STREAM_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec_tiny")
    write_speech_tokenizer(root, "tiny", seed=0)
    return root


@pytest.fixture(scope="module")
def tiny_decoder(tiny_dir):
    return load_codec_decoder(tiny_dir)


@pytest.fixture(scope="module")
def small_window_decoder(tmp_path_factory):
    """Window 5 over 3 layers: the receptive field (12 frames) is far shorter than the test sequences, so
    dropped or misplaced K/V history shows up."""
    root = tmp_path_factory.mktemp("codec_window5")
    write_speech_tokenizer(root, "tiny", seed=1, decoder_overrides={"sliding_window": 5, "num_hidden_layers": 3})
    return load_codec_decoder(root)


def random_codes(batch: int, frames: int, config: CodecDecoderConfig, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames), generator=generator)


def schedule(pattern: list[int], total: int) -> list[int]:
    """Chunk sizes following `pattern` (its last value repeated) until `total` frames are covered."""
    sizes, done = [], 0
    for size in itertools.chain(pattern, itertools.repeat(pattern[-1])):
        if done >= total:
            return sizes
        sizes.append(min(size, total - done))
        done += sizes[-1]
    raise AssertionError("unreachable")


def decode_in_chunks(decoder: CodecDecoder, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state = decoder.init_state(codes.shape[0])
    pieces, start = [], 0
    with torch.inference_mode():
        for size in sizes:
            pieces.append(decoder.decode_chunk(codes[:, :, start:start + size], state))
            start += size
    return torch.cat(pieces, dim=1)


# ---------------------------------------------------------------------------------------------- config


def test_config_reads_every_decoder_field_of_the_official_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FULL_SPEECH_TOKENIZER_CONFIG))
    config = CodecDecoderConfig.from_json(path)
    block = FULL_SPEECH_TOKENIZER_CONFIG["decoder_config"]
    for key, value in block.items():
        got = getattr(config, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
    assert config.samples_per_frame == 1920 and config.output_sample_rate == 24000
    assert CodecDecoderConfig.from_dict(block) == config  # the decoder block alone reads the same


@pytest.mark.parametrize("change, message", [
    ({"num_semantic_quantizers": 2}, "num_semantic_quantizers"),
    ({"upsample_rates": [8, 5, 4, 2]}, "decode_upsample_rate"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
])
def test_config_refuses_what_the_decoder_cannot_run(change, message):
    config = json.loads(json.dumps(FULL_SPEECH_TOKENIZER_CONFIG))
    config["decoder_config"].update(change)
    with pytest.raises(ValueError, match=message):
        CodecDecoderConfig.from_dict(config)


def test_full_size_decoder_has_the_released_parameter_count_and_file_layout():
    # design doc §4.3 / §7.4: 114,323,137 decoder parameters; 170,557,441 values in the whole file
    config = CodecDecoderConfig.from_dict(FULL_SPEECH_TOKENIZER_CONFIG)
    with torch.device("meta"):
        decoder = CodecDecoder(config)
    unused_input_projections = 2 * 256 * 512  # counted in the 114,323,137 of §4.3, never used to decode
    assert sum(p.numel() for p in decoder.parameters()) == 114_323_137 - unused_input_projections
    shapes = speech_tokenizer_tensor_shapes(speech_tokenizer_config("full"))
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 170_557_441
    assert shapes["decoder.quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"] == (2048, 256)
    assert shapes["decoder.upsample.0.0.conv.weight"] == (1024, 1024, 2)
    assert shapes["decoder.decoder.1.block.1.conv.weight"] == (1536, 768, 16)
    assert shapes["decoder.decoder.4.block.4.conv1.conv.weight"] == (96, 96, 7)
    assert shapes["decoder.decoder.6.conv.weight"] == (1, 96, 7)
    assert shapes["encoder.downsample.conv.weight"] == (512, 512, 4)
    assert sum(1 for k in shapes if k.startswith("encoder.")) > 200
    # per-stream streaming state (§6.3): about 1.3 M values, dominated by the 8 x 71 positions of K/V
    state_values = sum(torch.Size(s).numel() for s in decoder.state_shapes().values())
    assert state_values == 8 * 71 * 2 * 1024 + 1024 + 2 * 1024 * 6 + 1024 * 6 + (1536 + 768 + 384 + 192) \
        + 78 * (768 + 384 + 192 + 96) + 96 * 6


# ---------------------------------------------------------------------------------------------- checkpoint


def test_written_checkpoint_has_the_official_files_and_loads_strictly(tiny_dir, tiny_decoder):
    tokenizer_dir = tiny_dir / "speech_tokenizer"
    assert sorted(p.name for p in tokenizer_dir.iterdir()) == [
        "config.json", "configuration.json", "model.safetensors", "preprocessor_config.json"]
    tensors = load_file(tokenizer_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    config = json.loads((tokenizer_dir / "config.json").read_text())
    assert {k: tuple(v.shape) for k, v in tensors.items()} == speech_tokenizer_tensor_shapes(config)
    ignored = [k for k in tensors if is_ignored_codec_tensor(k)]
    assert any(k.startswith("encoder.") for k in ignored)
    assert len(ignored) == len(tensors) - len(tiny_decoder.state_dict())
    # loaded values are the file's values, including the non-trivial SnakeBeta / ConvNeXt / LayerScale ones
    for name, value in tiny_decoder.state_dict().items():
        assert torch.equal(value, tensors["decoder." + name]), name
    fresh_defaults = {"decoder.1.block.0.alpha": 0.0, "decoder.1.block.0.beta": 0.0, "upsample.0.1.gamma": 1e-6,
                      "pre_transformer.layers.0.mlp_layer_scale.scale": 0.01}
    for suffix, default in fresh_defaults.items():
        value = tensors["decoder." + suffix]
        assert (value - default).abs().mean() > 0.05 and value.std() > 0.01, suffix
    assert codec_state_dict_from_checkpoint(tensors).keys() == tiny_decoder.state_dict().keys()


def _corrupt(tiny_dir, tmp_path, edit):
    target = tmp_path / "speech_tokenizer"
    target.mkdir()
    for name in ("config.json", "preprocessor_config.json", "configuration.json"):
        (target / name).write_bytes((tiny_dir / "speech_tokenizer" / name).read_bytes())
    tensors = load_file(tiny_dir / "speech_tokenizer" / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target / "model.safetensors"


@pytest.mark.parametrize("edit, fragment", [
    (lambda t: t.pop("decoder.decoder.2.block.3.conv1.conv.weight"),
     "missing tensor 'decoder.decoder.2.block.3.conv1.conv.weight'"),
    (lambda t: t.__setitem__("decoder.pre_conv.conv.bias", torch.zeros(7)),
     "tensor 'decoder.pre_conv.conv.bias' has shape [7]"),
    (lambda t: t.__setitem__("decoder.upsample.1.1.gamma", t["decoder.upsample.1.1.gamma"].to(torch.int32)),
     "tensor 'decoder.upsample.1.1.gamma' has dtype torch.int32"),
    (lambda t: t.__setitem__("decoder.extra.weight", torch.zeros(3)), "unexpected tensor 'decoder.extra.weight'"),
])
def test_loader_names_the_wrong_tensor_and_the_file(tiny_dir, tmp_path, edit, fragment):
    weights = _corrupt(tiny_dir, tmp_path, edit)
    with pytest.raises(CheckpointError) as failure:
        load_codec_decoder(tmp_path)
    assert fragment in str(failure.value)
    assert str(weights) in str(failure.value)


def test_loader_reports_a_missing_speech_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_codec_decoder(tmp_path)
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "speech_tokenizer" / "config.json").write_text(json.dumps(speech_tokenizer_config("tiny")))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_codec_decoder(tmp_path)


def test_mapping_refuses_tensors_outside_encoder_and_decoder():
    with pytest.raises(ValueError, match="talker.codec_head.weight"):
        codec_state_dict_from_checkpoint({"talker.codec_head.weight": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------- decoding


def test_decode_shape_range_and_causality(tiny_decoder):
    codes = random_codes(2, 40, tiny_decoder.config, seed=3)
    wav = tiny_decoder.decode(codes)
    assert wav.shape == (2, 40 * 1920) and wav.dtype == torch.float32
    assert wav.abs().max() <= 1.0 and wav.std() > 0.05  # non-trivial audio, not all clipped
    assert (wav.abs() == 1.0).float().mean() < 0.05
    # appending frames never changes earlier samples; changing a frame changes samples from that frame on only
    longer = tiny_decoder.decode(torch.cat([codes, random_codes(2, 5, tiny_decoder.config, seed=4)], dim=2))
    assert (longer[:, :40 * 1920] - wav).abs().max() <= STREAM_TOLERANCE
    edited = codes.clone()
    edited[:, 0, 20] = (codes[:, 0, 20] + 1) % tiny_decoder.config.codebook_size
    changed = tiny_decoder.decode(edited)
    assert (changed[:, :20 * 1920] - wav[:, :20 * 1920]).abs().max() <= STREAM_TOLERANCE
    assert (changed[:, 20 * 1920:21 * 1920] - wav[:, 20 * 1920:21 * 1920]).abs().max() > 1e-3


def test_whole_decode_in_bounded_pieces_equals_one_call(tiny_decoder):
    codes = random_codes(1, 100, tiny_decoder.config, seed=8)
    one_call = tiny_decoder.decode(codes, max_frames_per_call=100)
    assert (tiny_decoder.decode(codes, max_frames_per_call=33) - one_call).abs().max() <= STREAM_TOLERANCE


def test_decode_refuses_bad_codes(tiny_decoder):
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        tiny_decoder.decode(torch.full((1, 4, 3), 64))
    with pytest.raises(ValueError, match="codes must be"):
        tiny_decoder.decode(torch.zeros((1, 3, 3), dtype=torch.long))


SCHEDULES = {
    "grow_2_4_8_12": [2, 4, 8, 12],
    "ones": [1],
    "uneven_3_7": [3, 7, 5, 11, 2],
    "one_big_then_ones": [80, 1],
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_chunked_decode_equals_whole_decode(tiny_decoder, name):
    # 110 frames: longer than the 72-frame window, so the K/V history slides
    codes = random_codes(2, 110, tiny_decoder.config, seed=5)
    whole = tiny_decoder.decode(codes)
    chunked = decode_in_chunks(tiny_decoder, codes, schedule(SCHEDULES[name], 110))
    assert chunked.shape == whole.shape
    assert (chunked - whole).abs().max().item() <= STREAM_TOLERANCE


@pytest.mark.parametrize("name", ["grow_2_4_8_12", "ones", "uneven_3_7"])
def test_chunked_decode_equals_whole_decode_with_a_short_window(small_window_decoder, name):
    codes = random_codes(1, 60, small_window_decoder.config, seed=6)
    whole = small_window_decoder.decode(codes)
    chunked = decode_in_chunks(small_window_decoder, codes, schedule(SCHEDULES[name], 60))
    assert (chunked - whole).abs().max().item() <= STREAM_TOLERANCE
    # the window really limits attention: frames far apart do not interact through the transformer,
    # but a change 2 frames back does reach the current frame
    far, near = codes.clone(), codes.clone()
    far[:, :, 10] = (far[:, :, 10] + 1) % small_window_decoder.config.codebook_size
    near[:, :, 48] = (near[:, :, 48] + 1) % small_window_decoder.config.codebook_size
    frame = slice(50 * 1920, 51 * 1920)
    assert (small_window_decoder.decode(far)[:, frame] - whole[:, frame]).abs().max() <= STREAM_TOLERANCE
    assert (small_window_decoder.decode(near)[:, frame] - whole[:, frame]).abs().max() > 1e-3


def test_batched_streams_at_different_positions_share_one_call(tiny_decoder):
    """An engine-style pool: streams join at different times and are decoded together, each with its own
    state row; every stream's audio equals its own whole decode."""
    config = tiny_decoder.config
    streams = [random_codes(1, 90, config, seed=10 + i)[0] for i in range(3)]  # each [Q, 90]
    whole = [tiny_decoder.decode(s[None])[0] for s in streams]
    pool = tiny_decoder.init_state(4)  # slot 3 stays unused
    pool.positions.fill_(7)  # stale content from an earlier stream ...
    pool.tensors["pre_conv"].fill_(3.0)
    pool.reset_([0, 1, 2])  # ... cleared when the slots are handed out
    produced = [[] for _ in streams]
    offsets = [0, 0, 0]
    # stream 0 starts alone, 1 joins at step 2 and 2 at step 4; rows come in rotating order and each step
    # decodes the same number of frames for every row in it (growing, then uneven sizes)
    joins, sizes = [0, 2, 4], itertools.cycle([2, 4, 8, 12, 3, 7, 1, 16])
    step = 0
    with torch.inference_mode():
        while min(offsets) < 90:
            active = [r for r in range(3) if joins[r] <= step and offsets[r] < 90]
            rows = active[step % len(active):] + active[:step % len(active)]
            if step % 3 == 2 and len(rows) > 1:
                rows = rows[:-1]  # sometimes a stream sits a step out
            frames = min(next(sizes), *(90 - offsets[r] for r in rows))
            batch = pool.index_select(rows)
            codes = torch.stack([streams[r][:, offsets[r]:offsets[r] + frames] for r in rows])
            wav = tiny_decoder.decode_chunk(codes, batch)
            pool.index_copy_(rows, batch)
            for i, r in enumerate(rows):
                produced[r].append(wav[i])
                offsets[r] += frames
            step += 1
    assert offsets == [90, 90, 90]
    assert pool.positions.tolist()[:3] == [90, 90, 90]
    for got, want in zip(produced, whole):
        assert (torch.cat(got) - want).abs().max().item() <= STREAM_TOLERANCE


def test_state_is_bounded_and_static_buffers_can_be_reused(tiny_decoder):
    """The state's size does not grow with the stream, and a preallocated (graph-style) state is updated in
    place: same storage before and after every call."""
    config = tiny_decoder.config
    codes = random_codes(2, 100, config, seed=20)
    pool = tiny_decoder.init_state(2)
    static = tiny_decoder.init_state(2)
    pointers = {k: t.data_ptr() for k, t in static.tensors.items()}
    shapes = {k: t.shape for k, t in static.tensors.items()}
    pieces = []
    with torch.inference_mode():
        for start in range(0, 100, 4):
            static.copy_rows_from_(pool, [1, 0])  # gather into the static buffers, rows swapped
            pieces.append(tiny_decoder.decode_chunk(codes[[1, 0], :, start:start + 4], static))
            pool.index_copy_([1, 0], static)
    assert {k: t.data_ptr() for k, t in static.tensors.items()} == pointers
    assert {k: t.shape for k, t in static.tensors.items()} == shapes
    whole = tiny_decoder.decode(codes[[1, 0]])
    assert (torch.cat(pieces, dim=1) - whole).abs().max().item() <= STREAM_TOLERANCE
    split = pool.split()
    assert len(split) == 2 and split[0].batch_size == 1
    assert torch.equal(type(pool).cat(split).positions, pool.positions)
    assert pool.nbytes_per_stream() == sum(t[0].numel() * t.element_size() for t in pool.tensors.values())
