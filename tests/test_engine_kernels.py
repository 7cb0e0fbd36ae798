"""The Triton decode kernels (tts_backend/engine/kernels.py) against the layer they replace.

Triton's interpreter runs the kernels on the CPU (fp32; it has no bf16), so each check runs in a child
process started with TRITON_INTERPRET=1, which must be set before the kernels are defined. On the GPU the
same kernels run compiled in bf16; bench/qwen3_gpu_check.py compares them there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: float = 300) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_decode_layer_equals_the_layer_function():
    """Rows spanning one and two row tiles, positions in the first attention block, across blocks, and 0;
    K/V land in the right slot and position; nothing else in the cache changes."""
    result = run_interpreted("""
        import json, torch
        from tts_backend.engine import kernels
        from tts_backend.engine.fused import make_layer_fn
        torch.manual_seed(0)
        out = []
        for heads, kv, head_dim, width, inner, rows in [(4, 2, 32, 64, 128, 3), (4, 1, 32, 96, 160, 20),
                                                        (2, 2, 64, 48, 80, 1)]:
            eps, theta, cache_len, slots_total = 1e-6, 1e6, 80, 24
            def rnd(*shape, scale=0.2):
                return torch.randn(*shape) * scale
            weights = (1 + rnd(width), rnd((heads + 2 * kv) * head_dim, width), 1 + rnd(head_dim),
                       1 + rnd(head_dim), rnd(width, heads * head_dim), 1 + rnd(width), rnd(2 * inner, width),
                       rnd(width, inner))
            k_cache, v_cache = rnd(slots_total, kv, cache_len, head_dim), rnd(slots_total, kv, cache_len, head_dim)
            k_mine, v_mine = k_cache.clone(), v_cache.clone()
            slots = torch.randperm(slots_total)[:rows]
            pos = torch.randint(0, cache_len, (rows,))
            pos[0] = 0
            x = rnd(rows, width, scale=1.0)
            ref = make_layer_fn(heads, kv, head_dim, eps, theta)(
                x[:, None], *weights, k_cache, v_cache, slots, pos[:, None], torch.arange(cache_len))[:, 0]
            got = kernels.decode_layer(x, weights, k_mine, v_mine, slots, pos, heads, eps, theta)
            out.append({"err": (got - ref).abs().max().item(), "scale": ref.abs().max().item(),
                        "k_err": (k_mine - k_cache).abs().max().item(), "v_err": (v_mine - v_cache).abs().max().item(),
                        "k_moved": (k_mine != k_cache).any(-1).sum().item(), "rows": rows, "kv": kv})
        print(json.dumps(out))
    """)
    for case in result:
        assert case["err"] <= 1e-4 * case["scale"], case
        assert case["k_err"] < 1e-4 and case["v_err"] < 1e-5, case
        # K/V written exactly at (slot, kv head, pos) of each row, nowhere else: the reference wrote the same
        # places, so a difference anywhere would show as k_err; check at least one vector changed per row.
        assert case["k_moved"] <= case["rows"] * case["kv"], case


def test_engine_on_the_triton_kernels_equals_the_model_modules(tmp_path):
    """The whole engine (Talker decode and the 15-step loop on the kernels) speaks what the plain modules
    speak, request by request, on a checkpoint whose shapes the kernels take."""
    result = run_interpreted(f"""
        import asyncio, json
        import numpy as np, torch
        from tts_backend.base import SynthesisRequest
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        from tts_backend.registry import create_backend
        torch.set_num_threads(1)
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=3)

        async def speak(options):
            backend = create_backend("qwen3", model=str(path), device="cpu", dtype="float32", max_active=4, max_len=256,
                                     sampler="stateless", trim_leading_silence=False, runner_options=options)
            await backend.start()
            try:
                runner = backend.engine.runner
                used = runner.triton
                requests = [SynthesisRequest(text="Hello there, kernels." * (i + 1), voice="ryan", seed=i,
                                             max_new_tokens=12) for i in range(3)]
                async def one(r):
                    return b"".join([c.pcm async for c in backend.synthesize(r)])
                return used, await asyncio.gather(*(one(r) for r in requests))
            finally:
                await backend.stop()

        async def main():
            plain_used, plain = await speak({{"fused": False}})
            fast_used, fast = await speak({{"fused": True, "kernels": "triton"}})
            diffs = [int(np.abs(np.frombuffer(a, "<i2").astype(np.int32) - np.frombuffer(b, "<i2")).max())
                     if len(a) == len(b) else -1 for a, b in zip(plain, fast)]
            print(json.dumps({{"plain_used": plain_used, "fast_used": fast_used, "diffs": diffs,
                               "lengths": [len(a) for a in plain]}}))
        asyncio.run(main())
    """, timeout=600)
    assert result["plain_used"] is False and result["fast_used"] is True
    assert all(n > 0 for n in result["lengths"])
    assert all(0 <= d <= 1 for d in result["diffs"]), result


def test_kernels_refuse_shapes_they_cannot_tile():
    from tts_backend.engine.fused import kernels_fit
    from tts_backend.qwen3.config import Qwen3TTSConfig
    from tts_backend.qwen3.testing.checkpoint import model_config

    tiny = Qwen3TTSConfig.from_dict(model_config("tiny")).talker
    small = Qwen3TTSConfig.from_dict(model_config("small")).talker
    full = Qwen3TTSConfig.from_dict(model_config("1.7b")).talker
    assert not kernels_fit(tiny) and not kernels_fit(tiny.code_predictor)  # head_dim 8; the predictor is 24 wide
    assert kernels_fit(small) and kernels_fit(small.code_predictor)
    assert kernels_fit(full) and kernels_fit(full.code_predictor)


def test_sample_rows_draws_what_the_residual_sampler_draws():
    """Temperature, top-k and the counter-based Gumbel noise give the same codes as fused.residual_sampler
    (and argmax when greedy), each row with its own seed and counter; the next input is the table row."""
    result = run_interpreted("""
        import json, torch
        from tts_backend.engine import kernels
        from tts_backend.engine.fused import residual_sampler
        from tts_backend.qwen3.sampling import SamplingParams
        torch.manual_seed(0)
        out = {}
        for vocab, top_k in [(64, 5), (2048, 50), (256, 1000)]:
            logits = torch.randn(7, vocab) * 3
            logits[0, :2] = 50.0  # a tie at the top: the lower id wins in both
            seeds = torch.randint(0, 2**31 - 1, (7,))
            counters = torch.randint(0, 5000, (7,))
            table = torch.randn(vocab, 48)
            params = SamplingParams(subtalker_temperature=0.9, subtalker_top_k=top_k)
            want = residual_sampler(params, compile=False)(logits, seeds, counters + 3)
            codes = torch.zeros(7, 4, dtype=torch.long)
            nxt = kernels.sample_rows(logits, seeds, counters, 3, codes[:, 1], 0.9, top_k, True, table)
            greedy = torch.zeros(7, dtype=torch.long)
            kernels.sample_rows(logits, seeds, counters, 3, greedy, 0.9, top_k, False)
            out[str(vocab)] = {"same": bool(torch.equal(codes[:, 1], want)),
                               "others_untouched": bool((codes[:, [0, 2, 3]] == 0).all()),
                               "next_ok": bool(torch.equal(nxt, table[want])),
                               "greedy_ok": bool(torch.equal(greedy, logits.argmax(-1))),
                               "spread": len(set(want.tolist()))}
        print(json.dumps(out))
    """)
    for vocab, case in result.items():
        assert case["same"] and case["others_untouched"] and case["next_ok"] and case["greedy_ok"], (vocab, case)
        assert case["spread"] > 1  # the draws are not all the argmax


def test_a_sampling_tail_that_fails_to_capture_falls_back_alone(tmp_path):
    """If the predictor's Triton sampling tail fails at capture, only it goes: the predictor graphs are
    captured again with the compiled sampler, and the Triton layers stay."""
    result = run_interpreted(f"""
        import json, torch
        from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
        from tts_backend.qwen3.generate import Qwen3TTS
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=4)
        model = Qwen3TTS.from_pretrained(str(path), device="cpu", dtype=torch.float32)
        runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=128, sampler="stateless",
                                  fused=True, compile=False, kernels="triton", decode_buckets=(1, 2),
                                  prefill_len_buckets=(32,), codec_frames=(2,), codec_batch_buckets=(1,)))
        with torch.inference_mode():
            runner._allocate()
        tail_at_start = runner.fused_cp.fused_tail
        captured = []

        def capture(key, fn, example_inputs, warmup=2):
            if key[0] == "cp" and runner.fused_cp.fused_tail:
                raise RuntimeError("simulated compiler failure")
            with torch.inference_mode():
                fn(*example_inputs)
            captured.append(key[0])

        runner.graphs.capture = capture
        runner._capture_all()
        print(json.dumps({{"tail_at_start": tail_at_start, "tail_now": runner.fused_cp.fused_tail,
                           "triton": runner.triton, "cp_captures": captured.count("cp")}}))
    """)
    assert result == {"tail_at_start": True, "tail_now": False, "triton": True, "cp_captures": 2}


def test_triton_layers_that_fail_to_capture_fall_back_to_the_compiled_layers(tmp_path):
    """If the Triton layer kernels fail at capture (with and without the sampling tail), the Talker and the
    predictor are captured on the compiled layers, with the attended length in buckets again."""
    result = run_interpreted(f"""
        import json, torch
        from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
        from tts_backend.qwen3.generate import Qwen3TTS
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=4)
        model = Qwen3TTS.from_pretrained(str(path), device="cpu", dtype=torch.float32)
        runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=128, sampler="stateless",
                                  fused=True, compile=False, kernels="triton", decode_buckets=(1, 2),
                                  attend_buckets=(64,), prefill_len_buckets=(32,), codec_frames=(2,),
                                  codec_batch_buckets=(1,)))
        with torch.inference_mode():
            runner._allocate()
        captured = []

        def capture(key, fn, example_inputs, warmup=2):
            if key[0] in ("decode", "cp") and runner.triton:
                raise RuntimeError("simulated compiler failure")
            with torch.inference_mode():
                fn(*example_inputs)
            captured.append(key)

        runner.graphs.capture = capture
        runner._capture_all()
        print(json.dumps({{"triton": runner.triton, "tail": runner.fused_cp.fused_tail,
                           "attend": list(runner.attend_buckets), "kernels": runner.fused_talker.kernels is None,
                           "decode": sorted(k[1:] for k in captured if k[0] == "decode"),
                           "cp": sorted(k[1] for k in captured if k[0] == "cp")}}))
    """)
    assert result == {"triton": False, "tail": False, "attend": [64, 128], "kernels": True,
                      "decode": [[1, 64], [1, 128], [2, 64], [2, 128]], "cp": [1, 2]}


def test_the_start_up_check_keeps_agreeing_kernels_and_drops_what_disagrees(tmp_path):
    """Before capture the runner compares the kernels with the layers on this device: kernels that agree
    serve; an attention kernel that computes garbage turns the Triton layers off (the engine then serves on
    the compiled layers); a draw that picks other codes turns only the sampling tail off."""
    result = run_interpreted(f"""
        import json, torch
        from tts_backend.engine import kernels
        from tts_backend.engine.runner import Qwen3ModelRunner, Qwen3RunnerConfig
        from tts_backend.qwen3.generate import Qwen3TTS
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=4)
        model = Qwen3TTS.from_pretrained(str(path), device="cpu", dtype=torch.float32)
        attend, sample_rows = kernels.attend, kernels.sample_rows

        def prepared():
            runner = Qwen3ModelRunner(model, Qwen3RunnerConfig(max_slots=2, max_len=96, sampler="stateless",
                                      fused=True, compile=False, kernels="triton"))
            runner.prepare()
            return {{"check": runner.kernel_check, "triton": runner.triton, "tail": runner.fused_cp.fused_tail,
                    "talker_kernels": runner.fused_talker.kernels is not None, "fast_path": runner.fast_path()}}

        out = {{"agree": prepared()}}
        kernels.attend = lambda *a, **k: attend(*a, **k) * 0.5  # wrong attention output, right cache writes
        out["bad_attention"] = prepared()
        kernels.attend = attend

        def shifted(logits, seeds, counters, offset, codes, *rest):
            table = sample_rows(logits, seeds, counters, offset, codes, *rest)
            codes.add_(1).remainder_(logits.shape[1])
            return table
        kernels.sample_rows = shifted
        out["bad_draw"] = prepared()
        print(json.dumps(out))
    """)
    agree, bad_attention, bad_draw = result["agree"], result["bad_attention"], result["bad_draw"]
    assert agree["triton"] and agree["tail"] and agree["talker_kernels"]
    check = agree["check"]
    assert max(check["talker_layer"], check["predictor_layer"], check["predictor_paired"]) < 1e-4, check
    assert check["tail_logits"] < 1e-5 and check["tail_draws"] == 1.0, check
    assert bad_attention["check"]["layers_ok"] is False and bad_attention["check"]["talker_layer"] > 0.15
    assert not bad_attention["triton"] and not bad_attention["tail"] and not bad_attention["talker_kernels"]
    assert bad_draw["check"]["layers_ok"] and not bad_draw["check"]["tail_ok"]
    assert bad_draw["triton"] and not bad_draw["tail"]
    # What monitoring sees (voxgate_engine_fast_path): the pieces that fell back read 0.
    assert agree["fast_path"]["triton_layers"] and agree["fast_path"]["sampling_tail"]
    assert not bad_attention["fast_path"]["triton_layers"] and not bad_attention["fast_path"]["sampling_tail"]
    assert bad_draw["fast_path"]["triton_layers"] and not bad_draw["fast_path"]["sampling_tail"]


def test_a_paired_launch_equals_two_passes():
    """Two positions of each row in one launch (pair_offset): the second attends to the first from the same
    launch's q|k|v, and outputs and caches equal two launches of one position each."""
    result = run_interpreted("""
        import json, torch
        from tts_backend.engine import kernels
        torch.manual_seed(1)
        heads, kv, head_dim, width, inner, eps, theta = 4, 2, 32, 64, 128, 1e-6, 1e6
        def rnd(*shape, scale=0.2):
            return torch.randn(*shape) * scale
        weights = (1 + rnd(width), rnd((heads + 2 * kv) * head_dim, width), 1 + rnd(head_dim), 1 + rnd(head_dim),
                   rnd(width, heads * head_dim), 1 + rnd(width), rnd(2 * inner, width), rnd(width, inner))
        rows = torch.tensor([2, 0, 3])
        k_cache, v_cache = rnd(4, kv, 16, head_dim), rnd(4, kv, 16, head_dim)
        k_two, v_two = k_cache.clone(), v_cache.clone()
        first, second = rnd(3, width, scale=1.0), rnd(3, width, scale=1.0)
        zeros, ones = torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long)
        kernels.decode_layer(first, weights, k_two, v_two, rows, zeros, heads, eps, theta)
        want = kernels.decode_layer(second, weights, k_two, v_two, rows, ones, heads, eps, theta)
        got = kernels.decode_layer(torch.cat((first, second)), weights, k_cache, v_cache, torch.cat((rows, rows)),
                                   torch.cat((zeros, ones)), heads, eps, theta, pair_offset=3)[3:]
        print(json.dumps({"err": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                          "k": (k_cache - k_two).abs().max().item(), "v": (v_cache - v_two).abs().max().item()}))
    """)
    assert result["err"] <= 1e-5 * result["scale"] and result["k"] < 1e-6 and result["v"] < 1e-6, result


def test_the_predictor_loop_draws_the_same_codes_with_and_without_the_sampling_tail(tmp_path):
    """The Triton predictor loop with its fused step tail and with the compiled sampler (its fallback) give
    the same residual codes and frame embedding for the same rows, seeds and counters."""
    result = run_interpreted(f"""
        import json, torch
        from tts_backend.engine.fused import FusedCodePredictor, PerLayerKV
        from tts_backend.qwen3.generate import Qwen3TTS
        from tts_backend.qwen3.testing.checkpoint import write_checkpoint
        path = write_checkpoint({str(tmp_path)!r} + "/small", "small", seed=6)
        model = Qwen3TTS.from_pretrained(str(path), device="cpu", dtype=torch.float32, load_codec=False)
        params, talker = model.sampling_params(), model.config.talker
        hidden = torch.randn(3, talker.hidden_size)
        c0 = torch.tensor([3, 17, 40])
        rows, seeds, counters = torch.arange(3), torch.tensor([5, 6, 7]), torch.tensor([0, 31, 400])
        out = {{}}
        with torch.inference_mode():
            for tail in (True, False):
                loop = FusedCodePredictor(model.code_predictor, model.talker, params, compile=False, triton=True,
                                          max_rows=4)
                loop.fused_tail = tail
                cache = PerLayerKV.for_stack(talker.code_predictor, 4, model.num_code_groups, "cpu", torch.float32)
                out[tail] = loop.run(hidden, c0, cache, rows, seeds, counters)
        print(json.dumps({{"codes_equal": bool(torch.equal(out[True][0], out[False][0])),
                           "embed_err": (out[True][1] - out[False][1]).abs().max().item(),
                           "spread": len(set(out[True][0].flatten().tolist()))}}))
    """)
    assert result["codes_equal"] and result["embed_err"] < 1e-5 and result["spread"] > 3, result
