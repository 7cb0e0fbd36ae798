"""A row's attention on the CPU gives the same bits however far its batch attends (qwen3.talker.attend_length)."""
from __future__ import annotations

import torch
from tests.qwen3_fixtures import tiny_custom_voice  # noqa: F401 - fixture


@torch.inference_mode()
def test_a_rows_attention_does_not_follow_how_far_its_batch_attends(tiny_custom_voice):
    # The eager decode attends as far as the batch's longest row (runner.decode), a prefill as far as its longest
    # prompt: a row's hidden state must be the same bits however far past its own keys that is, or its sampled
    # codes depend on its batch company (seen on an AVX2 CPU: tests/test_engine_resume_codes.py).
    from tts_backend.engine.fused import FusedStack, PerLayerKV
    from tts_backend.qwen3.generate import Qwen3TTS

    model = Qwen3TTS.from_pretrained(str(tiny_custom_voice), device="cpu", dtype=torch.bfloat16)
    stack, cfg = model.talker.model, model.config.talker
    fused = FusedStack(stack, compile=False)
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        kv = PerLayerKV.for_stack(cfg, 1, 256, "cpu", torch.bfloat16)
        for t in (*kv.k, *kv.v):
            t.copy_(torch.randn(t.shape, generator=gen))
        plain = model.talker.new_cache(1, 256)  # the modules' cache, the same keys and values
        for i in range(cfg.num_hidden_layers):
            plain.k[i].copy_(kv.k[i])
            plain.v[i].copy_(kv.v[i])
        p = int(torch.randint(1, 150, (), generator=gen))
        x = torch.randn(1, 1, cfg.hidden_size, generator=gen).bfloat16()
        slots, pos = torch.zeros(1, dtype=torch.long), torch.tensor([[p]])
        for name, run in (("fused", lambda a: fused.forward(x, kv, slots, pos, a)),
                          ("modules", lambda a: stack.run_layers(x, plain, slots, pos, a))):
            own = run(p + 1)
            for extra in (1, 5, 13, 40, 100):
                assert torch.equal(own, run(min(p + 1 + extra, 256))), (name, p, extra)
