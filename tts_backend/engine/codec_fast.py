"""The codec's fast path as the runner turns it on: fused.py's pieces, and with codec_channels_last
codec_channels_last.py's stages (which build on fused.py's, so the choice between them lives here, above both)."""

from __future__ import annotations

import torch

from .codec_channels_last import route_codec_convolutions_channels_last
from .fused import _codec_rvq, _codec_rvq_tables, _compile, _route_codec_convolutions, _route_codec_layers, _snake_beta


def fuse_codec_activations(codec, compile: bool, convolutions: bool = True, channels_last: bool = False) -> int:
    """The codec's fast path: the RVQ dequantisation as one gather over projected tables (always), and with
    `compile`, each pre-transformer layer through one compiled function and (with `convolutions`) the decoder's
    convolution stages through fused.py's `_route_codec_convolutions` (every SnakeBeta, conv bias, history update and
    residual add inside a compiled function or a GEMM), or with `channels_last` too through
    codec_channels_last.py's (the same stages on [B, T, C] activations and NHWC convolutions); any SnakeBeta
    left runs as one compiled kernel (7 elementwise kernels become 1). Changes the instances' `forward` only
    (undone by fused.py's `unfuse_codec_activations`); returns how many modules were routed."""
    import functools

    from tts_backend.qwen3.codec import SnakeBeta

    if channels_last and not convolutions:
        raise ValueError("channels_last is a layout of the fused convolution stages: it needs convolutions=True")
    quantizer = codec.quantizer
    tables = _codec_rvq_tables(quantizer)
    books = torch.arange(tables.shape[0], device=tables.device)
    quantizer.forward = functools.partial(_codec_rvq, tables=tables, books=books)
    count = 1
    if not compile:
        return count
    snake = _compile(_snake_beta, True)
    for module in codec.modules():
        if isinstance(module, SnakeBeta):
            # Contiguous input: a strided one (a trimmed transposed convolution's output) is a variant of its own.
            module.forward = lambda x, alpha=module.alpha.detach(), beta=module.beta.detach(): snake(
                x.contiguous(), alpha, beta)
            count += 1
    if convolutions:
        route = route_codec_convolutions_channels_last if channels_last else _route_codec_convolutions
        # The tensors routing makes (zeros for an absent bias, folded weights) are arguments of compiled
        # functions beside detached parameters: made under inference mode (the runner's start-up) they would
        # carry other dispatch keys than those, and TorchDynamo traces each combination as a variant of its own.
        with torch.inference_mode(False), torch.no_grad():
            count += route(codec, True)
    return count + _route_codec_layers(codec, True)
