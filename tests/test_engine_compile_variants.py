"""Start-up compiles few graph variants (issue 22): on the H200 each TorchInductor compile costs about 8 s,
and 20 of them made a cold start 166 s. TorchDynamo decides the variants, so they are counted here on the
CPU with a backend that compiles nothing (bench/compile_variants.py), over every bucket the runner captures
in a reduced configuration that still has several batch sizes, frame counts and prompt lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("triton")


def test_capture_traces_one_variant_per_function_and_shape_class():
    code = textwrap.dedent("""
        import json
        from bench.compile_variants import count_variants
        print(json.dumps(count_variants("small", config_overrides=dict(
            max_slots=8, decode_buckets=(2, 4, 8), codec_batch_buckets=(2, 4, 8), codec_frames=(1, 2, 3, 4),
            prefill_len_buckets=(16, 32)))))
    """)
    # The Triton decode kernels run in Triton's interpreter, which must be chosen before Triton is imported.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # decode: the Talker's sampler and the final norm; cp: the frame embedding; codec: the pre-transformer
    # layer at one frame and at several, and the compiled functions of the fused channels-last convolution
    # stages, CUDA's default (3 without them: SnakeBeta and the layer twice); prefill: the layer over several
    # positions. Batch size, frame count and prompt length within a class add none (duck sizing, 1-row
    # batches and strided inputs each added some before).
    assert counts == {"decode": 2, "cp": 1, "codec": 7, "prefill": 1, "total": 11}, counts


def test_a_base_checkpoints_clone_prefills_trace_no_variant_of_their_own():
    """A Base checkpoint captures the embeddings prefill (cloned voices) and, with the voice prefix cache, the
    prefill of a prompt's rest after a cached prefix (fewer positions than it attends): both are the id
    prefill's variant (same strides, sizes symbolic)."""
    code = textwrap.dedent("""
        import json
        from bench.compile_variants import count_variants
        print(json.dumps(count_variants("small", model_type="base", config_overrides=dict(
            max_slots=8, decode_buckets=(2, 4, 8), codec_batch_buckets=(2, 4, 8), codec_frames=(1, 2, 3, 4),
            prefill_len_buckets=(16, 32), clone_prefill_len_buckets=(16, 32, 64, 128),
            voice_kv_rest_buckets=(16, 32, 64, 96)))))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"decode": 2, "cp": 1, "codec": 7, "prefill": 1, "prefill_embeds": 0, "prefill_rest": 0,
                      "total": 11}, counts


def test_the_fused_codec_convolutions_trace_five_variants_more():
    """runner_options codec_fused_convolutions (on CUDA by default) in their [B, C, T] layout: the fused
    convolution stages' functions are compiles of their own at a cold start; counted so that what they cost in
    start-up cannot grow unseen (the channels-last layout, the default with them, below)."""
    code = textwrap.dedent("""
        import json
        from bench.compile_variants import count_variants
        print(json.dumps(count_variants("small", config_overrides=dict(
            max_slots=8, decode_buckets=(2, 4, 8), codec_batch_buckets=(2, 4, 8), codec_frames=(1, 2, 3, 4),
            prefill_len_buckets=(16, 32), codec_fused_convolutions=True, codec_channels_last=False))))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"decode": 2, "cp": 1, "codec": 8, "prefill": 1, "total": 12}, counts


def test_the_resume_pass_traces_no_variant_of_its_own():
    """A resumed request's Talker pass (uncaptured: a prompt plus its delivered frames, two rows, per-row
    starts) runs on what capture traced, at any length: no compile on the engine thread at a failover, and so
    nothing to warm at start-up."""
    code = textwrap.dedent("""
        import json
        from bench.compile_variants import count_variants
        print(json.dumps(count_variants("small", config_overrides=dict(
            max_slots=8, decode_buckets=(2, 4, 8), codec_batch_buckets=(2, 4), codec_frames=(1, 2),
            prefill_len_buckets=(16, 32)), resume_lengths=(18, 45, 64, 130, 300))))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["resume"] == 0 and counts["prefill"] == 1, counts


@pytest.mark.parametrize("channels_last, codec_variants", [(False, 8), (True, 7)])
def test_the_fused_codec_serves_every_call_on_what_capture_traced(channels_last, codec_variants):
    """With codec_fused_convolutions on (and codec_channels_last: its stages on [B, T, C] activations, one
    compiled function fewer), no codec call after start-up traces anything (a trace on the engine thread is
    an Inductor compile of seconds): every batch bucket at every frame count the scheduler asks for (the
    captured counts, the others as captured pieces, first chunks and bulk calls alike), a resumed request's
    two-row priming and a cloned voice's 64-frame reference priming run on the variants capture traced. Here
    every call, captured or not, goes through TorchDynamo's guards again (on CUDA a captured call replays
    without them), so a shape, layout or dispatch key that capture did not trace fails this test. Priming one
    row instead of two, for one, traces all the codec variants again."""
    code = textwrap.dedent(f"""
        import json
        from bench.compile_variants import count_variants
        print(json.dumps(count_variants("small", config_overrides=dict(
            max_slots=4, decode_buckets=(2, 4), codec_batch_buckets=(2, 4), codec_frames=(1, 2, 4, 8, 12),
            prefill_len_buckets=(16,), codec_fused_convolutions=True, codec_channels_last={channels_last}),
            codec_serving=True)))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["codec"] == codec_variants and counts["codec_serving"] == 0, counts
