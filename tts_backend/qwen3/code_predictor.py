"""The code predictor ("sub-talker"): codebooks 1..G-1 of a frame, given the talker's hidden state and code 0.

Per frame (spec §3.3): positions 0 and 1 are [talker hidden h, talker C(c0)], both projected to the predictor
width; lm_head[0] at position 1 gives c1. Then for k = 1..G-2 the input at position k+1 is
proj(codec_embedding[k-1](c_k)) and lm_head[k] gives c_{k+1}. The KV cache is per frame (positions 0..G-1),
so one slot per batch row is reused every frame without clearing: every position is rewritten before it is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import CodePredictorConfig, TalkerConfig
from .talker import DecoderStack, KVCache


class CodePredictorBackbone(DecoderStack):
    """`talker.code_predictor.model`: layers, norm, and one talker-width embedding table per residual book."""

    def __init__(self, cfg: CodePredictorConfig, talker_hidden_size: int):
        super().__init__(cfg)
        # Tables are talker-width (2048 in 1.7B), projected like every other predictor input.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden_size) for _ in range(cfg.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    def __init__(self, talker_cfg: TalkerConfig):
        super().__init__()
        cfg = talker_cfg.code_predictor
        assert cfg is not None
        self.cfg = cfg
        self.model = CodePredictorBackbone(cfg, talker_cfg.hidden_size)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )
        # Only when the widths differ (1.7B): Linear D_talker -> D_predictor with bias; identity otherwise.
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_cfg.hidden_size, cfg.hidden_size, bias=True)
            if cfg.hidden_size != talker_cfg.hidden_size
            else nn.Identity()
        )

    @property
    def num_residual_groups(self) -> int:
        return self.cfg.num_code_groups - 1

    def new_cache(self, num_slots: int, device=None, dtype=None) -> KVCache:
        w = self.lm_head[0].weight
        return KVCache.for_stack(self.cfg, num_slots, self.cfg.num_code_groups, device or w.device, dtype or w.dtype)

    def step(
        self,
        embeds: torch.Tensor,  # [B, S, D_talker] (S = 2 for the first step, 1 after)
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        input_pos: torch.Tensor,  # [B, S]
        group: int,  # which residual head: 0 predicts codebook 1
    ) -> torch.Tensor:
        """-> fp32 logits [B, vocab] of the last position for codebook group+1."""
        x = self.small_to_mtp_projection(embeds)
        hidden = self.model.run_layers(x, cache, slots, input_pos, attend_len=cache.max_len)
        return self.lm_head[group](hidden[:, -1]).float()

    def embed_residual(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G-1] (codebooks 1..G-1) -> [B, G-1, D_talker] via each book's own table."""
        return torch.stack([self.model.codec_embedding[i](codes[:, i]) for i in range(codes.shape[1])], dim=1)

    def predict(
        self,
        talker_hidden: torch.Tensor,  # [B, D_talker] final-norm talker hidden that produced c0
        c0_embed: torch.Tensor,  # [B, D_talker] talker C(c0)
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        choose: Callable[[torch.Tensor], torch.Tensor],  # fp32 logits [B, V] -> ids [B]; does the sampling
        logits_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The 15-step loop for a batch -> residual codes [B, G-1] (codebooks 1..G-1)."""
        B = talker_hidden.shape[0]
        device = talker_hidden.device
        codes = []
        embeds = torch.stack((talker_hidden, c0_embed), dim=1)  # [B, 2, D_talker]
        pos = torch.arange(2, device=device)[None].expand(B, 2)
        for group in range(self.num_residual_groups):
            logits = self.step(embeds, cache, slots, pos, group)
            if logits_out is not None:
                logits_out.append(logits)
            code = choose(logits)  # [B]
            codes.append(code)
            if group + 1 < self.num_residual_groups:
                embeds = self.model.codec_embedding[group](code)[:, None]  # [B, 1, D_talker]
                pos = torch.full((B, 1), group + 2, device=device, dtype=torch.long)
        return torch.stack(codes, dim=1)
