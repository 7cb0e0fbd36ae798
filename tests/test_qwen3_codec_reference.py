"""Parity of our 12 Hz codec decoder with the reference qwen-tts 0.1.1 decoder, in fp32 on random tiny checkpoints.

The reference runs in its own virtualenv (tests/reference_env.py) through its public wrapper
`Qwen3TTSTokenizer.decode`; tests/reference_scripts/codec_ref_decode.py also checks that the reference model
holds exactly the tensors of the file we wrote.

Long inputs: the reference decodes more than 300 frames in 300-frame windows, each after the first
re-decoding the 25 frames before it as context from a fresh start (design doc §4.4). Because the 8-layer
transformer sees 8 x 71 frames back (§6.2), its samples from frame 300 on are an approximation of the whole
decode; ours (whole or streamed) is the exact one. The test pins both facts: identical up to frame 300, and
after it the reference equals our decode of exactly its window (frames 275.., fresh state, first 25 dropped).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.qwen3_fixtures import single_torch_thread  # noqa: F401 - autouse fixture
from tests.reference_env import run_reference
from tts_backend.qwen3.loader import load_codec_decoder
from tts_backend.qwen3.testing.codec_checkpoint import (
    speech_tokenizer_config,
    speech_tokenizer_tensor_shapes,
    write_speech_tokenizer,
)

pytestmark = [pytest.mark.slow, pytest.mark.third_party]

SCRIPT = Path(__file__).parent / "reference_scripts" / "codec_ref_decode.py"
LAYOUT_SCRIPT = Path(__file__).parent / "reference_scripts" / "codec_ref_layout.py"
TOLERANCE = 1e-5
FRAME = 1920


def random_codes(q: int, frames: int, codebook_size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, codebook_size, (q, frames), generator=torch.Generator().manual_seed(seed))


# checkpoint name -> (decoder_overrides, seed, frame counts of the codes decoded as one padded batch)
CASES = {
    # short, longer than the 72-frame window, and longer than the reference's 300-frame chunk
    "tiny": ({}, 0, (37, 160, 330)),
    # window 6 over 3 layers with grouped K/V heads: masking and RoPE positions deep into the sequence
    "window6": ({"sliding_window": 6, "num_hidden_layers": 3, "num_key_value_heads": 2}, 7, (90,)),
}


@pytest.fixture(scope="module")
def parity_cases(tmp_path_factory):
    """Writes each checkpoint, then decodes all cases with the reference in one subprocess."""
    work = tmp_path_factory.mktemp("codec_parity")
    cases, args = {}, []
    for name, (overrides, seed, lengths) in CASES.items():
        tokenizer_dir = write_speech_tokenizer(work / name, "tiny", seed=seed, decoder_overrides=overrides)
        decoder = load_codec_decoder(work / name)
        c = decoder.config
        codes = [random_codes(c.num_quantizers, n, c.codebook_size, seed=seed + n) for n in lengths]
        codes_path, out_path = work / f"{name}_codes.npz", work / f"{name}_wavs.npz"
        np.savez(codes_path, **{f"c{i}": code.T.contiguous().numpy() for i, code in enumerate(codes)})
        args += [tokenizer_dir, codes_path, out_path]
        cases[name] = (decoder, codes, out_path)
    run_reference(SCRIPT, *args)
    results = {}
    for name, (decoder, codes, out_path) in cases.items():
        archive = np.load(out_path)
        results[name] = (decoder, codes, [archive[f"w{i}"] for i in range(len(codes))])
    return results


def test_decoder_matches_reference_on_the_tiny_checkpoint(parity_cases):
    decoder, codes, reference = parity_cases["tiny"]
    for code, ref in zip(codes[:2], reference[:2]):
        ours = decoder.decode(code[None])[0].numpy()
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= TOLERANCE
        assert np.abs(ref).max() > 0.1  # real signal, not silence


def test_long_input_matches_reference_up_to_its_300_frame_chunking(parity_cases):
    decoder, codes, reference = parity_cases["tiny"]
    long_codes, long_ref = codes[2], reference[2]
    ours = decoder.decode(long_codes[None])[0].numpy()
    assert ours.shape == long_ref.shape == (330 * FRAME,)
    head = slice(0, 300 * FRAME)
    assert np.abs(ours[head] - long_ref[head]).max() <= TOLERANCE
    window = decoder.decode(long_codes[None, :, 275:])[0].numpy()[25 * FRAME:]
    assert np.abs(window - long_ref[300 * FRAME:]).max() <= TOLERANCE
    # the reference's windowed tail really is an approximation of the whole decode
    assert np.abs(ours[300 * FRAME:] - long_ref[300 * FRAME:]).max() > 1e-3

    # streamed in growing chunks, ours equals the whole decode and hence the reference (first 300 frames)
    state, pieces, start = decoder.init_state(1), [], 0
    with torch.inference_mode():
        for size in [2, 4, 8] + [12] * 40:
            if start >= 330:
                break
            pieces.append(decoder.decode_chunk(long_codes[None, :, start:start + size], state)[0])
            start += size
    streamed = torch.cat(pieces).numpy()
    assert np.abs(streamed - ours).max() <= TOLERANCE
    assert np.abs(streamed[head] - long_ref[head]).max() <= TOLERANCE


def test_decoder_matches_reference_with_a_short_window_and_grouped_kv_heads(parity_cases):
    decoder, codes, reference = parity_cases["window6"]
    ours = decoder.decode(codes[0][None])[0].numpy()
    assert np.abs(ours - reference[0]).max() <= TOLERANCE
    assert np.abs(reference[0]).max() > 0.1


def test_full_size_layout_is_what_the_reference_model_expects(tmp_path):
    """Every tensor name and shape we write at the released size (decoder, unused RVQ input projections, Mimi
    encoder) is exactly the reference model's state dict; checked without writing 682 MB. (The tiny files are
    checked tensor by tensor when the reference loads them in the parity cases.)"""
    size = "full"
    config_path, out_path = tmp_path / "config.json", tmp_path / "layout.json"
    config_path.write_text(json.dumps(speech_tokenizer_config(size)))
    run_reference(LAYOUT_SCRIPT, config_path, out_path)
    reference = {name: tuple(shape) for name, shape in json.loads(out_path.read_text()).items()}
    assert speech_tokenizer_tensor_shapes(speech_tokenizer_config(size)) == reference
