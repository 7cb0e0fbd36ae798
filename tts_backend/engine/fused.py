"""Fewer, larger kernels for the engine's per-frame work (GPU fast path).

The model modules (tts_backend/qwen3) are written for clarity: one PyTorch op per line, about 60 kernels
per decoder layer. Replayed as a CUDA graph that is still ~3 us per kernel, and a frame runs 28 Talker
layers plus 16 x 5 code-predictor layers: about 6,000 kernels, 20 ms at batch 1 on an H200 (measured,
bench/results/engine_step_h200_run1_unfused.md), against a 1.25 ms weight-read floor.

Here the same math reads the same weights through:
  * concatenated projection weights (q|k|v in one matmul, gate|up in one), built once at start-up;
  * one pure function per decoder layer, compiled by TorchInductor (on CUDA) so that each chain of
    elementwise ops and reductions (RMSNorm, QK-norm + RoPE, residual adds, SiLU * up) is one kernel; the
    same compiled function serves every layer of a stack (weights are arguments, shapes are dynamic);
  * a compiled sampler (temperature, top-k, counter-based Gumbel noise, argmax) and a compiled frame-embedding
    sum.
On the CPU the functions run eagerly (same numbers, no compiler needed), which is how CI checks them
against the modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tts_backend.qwen3.sampling import warp
from tts_backend.qwen3.talker import attend_length

from .sampling_noise import gumbel_noise


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, S, N, Dh], pos [B, S] -> rotated x (rotate-half pairing, angles in fp32 like the reference)."""
    head_dim = x.shape[-1]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=x.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [B, S, 1, Dh]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def make_layer_fn(n_heads: int, n_kv: int, head_dim: int, eps: float, theta: float):
    """One pre-norm decoder layer over S new positions of B rows, writing K/V into per-layer cache tensors."""

    def layer(x, ln1, wqkv, q_norm, k_norm, wo, ln2, wgu, wd, k_cache, v_cache, slots, pos, key_pos):
        # key_pos: arange(attend_len); the attended length travels as a tensor size, never as a Python int,
        # so the compiled graph has only tensor inputs (sizes symbolic) and one compile serves every length.
        B, S, _ = x.shape
        attend_len = key_pos.shape[0]
        h = _rms_norm(x, ln1, eps)
        q, k, v = F.linear(h, wqkv).split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
        q = _rope(_rms_norm(q.reshape(B, S, n_heads, head_dim), q_norm, eps), pos, theta)
        k = _rope(_rms_norm(k.reshape(B, S, n_kv, head_dim), k_norm, eps), pos, theta)
        rows = slots[:, None].expand(B, S)
        k_cache[rows, :, pos] = k
        v_cache[rows, :, pos] = v.reshape(B, S, n_kv, head_dim)
        keys = k_cache.narrow(2, 0, attend_len)[slots]  # [B, Hkv, A, Dh]
        values = v_cache.narrow(2, 0, attend_len)[slots]
        mask = (key_pos[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, S, A]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        x = x + F.linear(out.transpose(1, 2).reshape(B, S, n_heads * head_dim), wo)
        gate, up = F.linear(_rms_norm(x, ln2, eps), wgu).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, wd)

    return layer


def _guard_same_meta() -> None:
    """Inductor in torch 2.11 crashes in `remove_noop_ops` when a noop candidate's value is a SymInt/SymFloat
    (size placeholders under dynamic shapes): "'SymInt' object has no attribute 'size'" (seen on the H200,
    fixed upstream by pytorch/pytorch#181752). Apply the same guard: non-tensor values are never "same"."""
    from torch._inductor.fx_passes import post_grad

    original = post_grad.same_meta
    if getattr(original, "voxgate_guarded", False):
        return

    def same_meta(node1, node2):
        if not isinstance(node1.meta.get("val"), torch.Tensor) or not isinstance(node2.meta.get("val"), torch.Tensor):
            return False
        return original(node1, node2)

    same_meta.voxgate_guarded = True
    post_grad.same_meta = same_meta


def _compile(fn, enabled: bool):
    if not enabled:
        return fn
    import torch._dynamo

    _guard_same_meta()

    import torch.fx.experimental._config as shape_config

    # Each variant TorchDynamo traces is one TorchInductor compile, about 8 s of start-up on the H200 (issue
    # 22), so the functions are traced for as few shapes as possible: sizes that happen to be equal at the
    # first call (a batch of 64 rows and a table of 64 entries) must not be guarded equal ("duck sizing").
    # A size of 1 still gets a variant of its own (TorchDynamo specialises 0 and 1; treating them
    # size-obliviously breaks the broadcasts of size-1 dimensions), so the runner's buckets avoid batches of 1.
    shape_config.use_duck_shape = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _snake(x, a, b):
    """SnakeBeta's formula, a = e^alpha and b = e^beta shaped to broadcast over x's channels."""
    return x + (1.0 / (b + 1e-9)) * torch.pow(torch.sin(x * a), 2)


def _snake_beta(x, alpha, beta):
    """qwen3.codec.SnakeBeta.forward, as one function of its weights."""
    return _snake(x, torch.exp(alpha)[None, :, None], torch.exp(beta)[None, :, None])


def unfuse_codec_activations(codec) -> None:
    """Undo `fuse_codec_activations` (back to the classes' own forwards)."""
    for module in codec.modules():
        module.__dict__.pop("forward", None)


def _codec_rvq_tables(quantizer) -> torch.Tensor:
    """[Q, codebook_size, codebook_dim]: each codebook's normalised vectors already through its half's 1x1
    output projection. The projection has no bias, so projecting each vector and summing equals summing and
    then projecting (to fp32 rounding)."""
    tables = []
    for half in (quantizer.rvq_first, quantizer.rvq_rest):
        weight = half.output_proj.weight[:, :, 0]  # [codebook_dim, dim]
        for layer in half.vq.layers:
            book = layer._codebook
            vectors = book.embedding_sum / book.cluster_usage.clamp(min=1e-5)[:, None]
            tables.append(vectors @ weight.T)
    return torch.stack(tables).detach()


def _codec_rvq(codes, tables, books):
    """codes [B, Q, t] -> [B, codebook_dim, t]: one gather over the projected tables and one sum, instead of
    two lookups, a division and an add per codebook plus two projections (~60 kernels)."""
    return tables[books[None, :, None], codes].sum(1).transpose(1, 2)


def make_codec_layer_fn(n_heads: int, n_kv: int, head_dim: int, eps: float, past_len: int):
    """One codec pre-transformer layer (qwen3.codec.TransformerLayer) as a pure function of its weights; the
    sliding-window K/V history `past` [B, 2, Hkv, W-1, Dh] is updated in place."""

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    # enable_gqa as a literal: a value computed from the closure's ints is a SymBool under dynamic shapes,
    # which SDPA refuses (seen on the H200).
    if n_heads == n_kv:
        def attend(q, keys, values, mask):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=head_dim ** -0.5)
    else:
        def attend(q, keys, values, mask):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=head_dim ** -0.5,
                                                  enable_gqa=True)

    def layer(h, cos, sin, mask, past, ln1, wqkv, wo, attn_scale, ln2, wgu, wd, mlp_scale):
        B, t, _ = h.shape
        q, k, v = F.linear(_rms_norm(h, ln1, eps), wqkv).split([n_heads * head_dim, n_kv * head_dim,
                                                                n_kv * head_dim], dim=-1)
        q = rotate(q.view(B, t, n_heads, head_dim).transpose(1, 2), cos, sin)
        k = rotate(k.view(B, t, n_kv, head_dim).transpose(1, 2), cos, sin)
        v = v.view(B, t, n_kv, head_dim).transpose(1, 2)
        keys = torch.cat([past[:, 0], k], dim=2)
        values = torch.cat([past[:, 1], v], dim=2)
        past.copy_(torch.stack([keys[:, :, -past_len:], values[:, :, -past_len:]], dim=1))
        out = attend(q, keys, values, mask)
        h = h + attn_scale * F.linear(out.transpose(1, 2).reshape(B, t, n_heads * head_dim), wo)
        gate, up = F.linear(_rms_norm(h, ln2, eps), wgu).chunk(2, dim=-1)
        return h + mlp_scale * F.linear(F.silu(gate) * up, wd)

    return layer


def _route_codec_layers(codec, compile: bool) -> int:
    """Route each pre-transformer layer through one compiled function of its (concatenated) weights: rope,
    norms, layer scales and the history update fuse into a few kernels instead of ~30 per layer."""
    cfg = codec.config
    if cfg.attention_bias or cfg.sliding_window < 2:
        return 0  # the layer function has no biases and always carries a history
    layer_fn = _compile(make_codec_layer_fn(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                            cfg.rms_norm_eps, cfg.sliding_window - 1), compile)
    count = 0
    for layer in codec.pre_transformer.layers:
        a, m = layer.self_attn, layer.mlp
        weights = tuple(w.detach() for w in (
            layer.input_layernorm.weight, torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
            a.o_proj.weight, layer.self_attn_layer_scale.scale, layer.post_attention_layernorm.weight,
            torch.cat((m.gate_proj.weight, m.up_proj.weight)), m.down_proj.weight, layer.mlp_layer_scale.scale))

        def forward(h, rope, mask, state, key=a.state_key, weights=weights):
            cos, sin = rope
            return layer_fn(h, cos, sin, mask, state.tensors[key], *weights)

        layer.forward = forward
        count += 1
    return count


# The decoder's convolution stages. cuDNN convolutions take no bias (PyTorch adds it in a kernel of its own,
# one pass over every conv output), and the module path spends one kernel each on the SnakeBeta, the history
# concatenation, the history update and the residual add (bench/results/codec_profile_h100.json). Here:
#   * each conv runs without its bias; the bias is added where its output is next read, inside the compiled
#     function that reads it anyway (the SnakeBeta after a conv, the residual input after a transposed conv);
#   * a SnakeBeta feeding a causal conv is written straight into that conv's window [history | new] and the
#     history is updated in the same function;
#   * a kernel-size-1 conv plus its residual add is one batched GEMM accumulating into the residual
#     (baddbmm, beta=1), whose bias was added to the residual by the function that read it before;
#   * ConvNeXt's gamma is folded into pwconv2 (gamma * (W h + b) = (gamma W) h + gamma b) and its residual add
#     is the same kind of GEMM.
# Only floating-point rounding changes (reassociated sums); the tests bound it against the modules.


def _bias(b):
    return b[None, :, None]


def _conv_window(x, past):
    """A causal conv's input window [history | x]; the history keeps the window's last inputs (in place)."""
    window = torch.cat([past, x], dim=2)
    past.copy_(window[:, :, window.shape[2] - past.shape[2]:])
    return window


def _snake_window(x, past, alpha, beta):
    """SnakeBeta(x) written into the window of the causal (or transposed) conv that reads it."""
    return _conv_window(_snake_beta(x, alpha, beta), past)


def _unit_input(x, x_bias, past, alpha, beta, out_bias):
    """A ResidualUnit's input x + x_bias (x_bias: the deferred bias of the conv that made x, zeros when there is
    none): conv1's window of SnakeBeta(x), and the residual x + conv2's bias, which conv2's GEMM accumulates into."""
    x = x + _bias(x_bias)
    return _conv_window(_snake_beta(x, alpha, beta), past), x + _bias(out_bias)


def _snake_biased(h, bias, alpha, beta):
    """SnakeBeta(h + the producing conv's bias)."""
    return _snake_beta(h + _bias(bias), alpha, beta)


def _convnext_input(x, past, out_bias):
    """ConvNeXt's depthwise-conv window and its residual x + (gamma-scaled) pwconv2 bias."""
    return _conv_window(x, past), x + _bias(out_bias)


def make_convnext_hidden_fn(eps: float, channels_last: bool = False):
    """ConvNeXt's depthwise-conv output d (bias deferred; [B, C, t], or [B, t, C] when `channels_last`) ->
    GELU(pwconv1(LayerNorm(.))) [B, t, 4C]."""

    def mlp(h, ln_weight, ln_bias, w1, b1):
        return F.gelu(F.linear(F.layer_norm(h, (h.shape[-1],), ln_weight, ln_bias, eps), w1, b1))

    if channels_last:
        def hidden(d, d_bias, ln_weight, ln_bias, w1, b1):
            return mlp(d + d_bias, ln_weight, ln_bias, w1, b1)
    else:
        def hidden(d, d_bias, ln_weight, ln_bias, w1, b1):
            return mlp((d + _bias(d_bias)).transpose(1, 2), ln_weight, ln_bias, w1, b1)

    return hidden


def _accumulate(residual, weight, x):
    """residual += weight @ x per row: residual [B, C, t] (a fresh tensor this path owns), weight [C, K], x
    [B, K, t] (any strides) -> one GEMM with beta=1 on the residual's own storage (out of place, CUDA's
    baddbmm would first copy it into a new tensor); the weight is shared across the batch as an expanded,
    stride-0 view, never copied."""
    return residual.baddbmm_(weight.expand(x.shape[0], -1, -1), x)


class _CodecConvFns:
    """The compiled (on CUDA) pieces between the decoder's convolutions; one instance serves every stage."""

    def __init__(self, compile: bool, layer_norm_eps: float) -> None:
        self.snake_window = _compile(_snake_window, compile)
        self.unit_input = _compile(_unit_input, compile)
        self.snake_biased = _compile(_snake_biased, compile)
        self.convnext_input = _compile(_convnext_input, compile)
        self.convnext_hidden = _compile(make_convnext_hidden_fn(layer_norm_eps), compile)


def _weights(*tensors):
    # Each with a storage of its own: a view into a larger one (a checkpoint's tensors on the CPU can be) has a
    # storage offset, which TorchDynamo specialises 0/1 apart from the rest, so a bias at offset 0 (the zeros
    # standing in for an absent one) and one at an offset trace a compiled variant each.
    return tuple(t.detach() if t.storage_offset() == 0 else t.detach().clone() for t in tensors)


def _residual_unit_fn(unit, fns: _CodecConvFns):
    """ResidualUnit as (x, x_bias, state) -> x + conv2(act2(conv1(act1(x)))), x_bias deferred from x's conv."""
    conv1, conv2 = unit.conv1.conv, unit.conv2.conv
    key, dilation = unit.conv1.state_key, conv1.dilation[0]
    a1, b1, w1, bias1 = _weights(unit.act1.alpha, unit.act1.beta, conv1.weight, conv1.bias)
    a2, b2 = _weights(unit.act2.alpha, unit.act2.beta)
    w2, bias2 = _weights(conv2.weight[:, :, 0], conv2.bias)

    def forward(x, x_bias, state):
        window, residual = fns.unit_input(x, x_bias, state.tensors[key], a1, b1, bias2)
        h = F.conv1d(window, w1, None, dilation=dilation)
        return _accumulate(residual, w2, fns.snake_biased(h, bias1, a2, b2))

    return forward


def _decoder_block_forward(block, fns: _CodecConvFns):
    """DecoderBlock: SnakeBeta into the transposed conv's window; the transposed conv trims its k - s overlap
    samples through `padding` (k = 2s: the trim is s on each side, so the output is already the kept,
    contiguous samples) and its bias goes to the first residual unit's input."""
    snake, transposed = block.block[0], block.block[1]
    conv, stride, key = transposed.conv, transposed.stride, transposed.state_key
    alpha, beta, weight, bias = _weights(snake.alpha, snake.beta, conv.weight, conv.bias)
    padding = transposed.history * stride
    units = [_residual_unit_fn(unit, fns) for unit in block.block[2:]]
    no_bias = torch.zeros_like(bias)

    def forward(x, state):
        window = fns.snake_window(x, state.tensors[key], alpha, beta)
        x = F.conv_transpose1d(window, weight, None, stride=stride, padding=padding)
        x_bias = bias
        for unit in units:
            x, x_bias = unit(x, x_bias, state), no_bias
        return x

    return forward


def _convnext_forward(block, fns: _CodecConvFns):
    dw = block.dwconv.conv
    key, groups = block.dwconv.state_key, dw.groups
    gamma = block.gamma.detach()
    w_dw, b_dw, ln_w, ln_b, w1, b1 = _weights(dw.weight, dw.bias, block.norm.weight, block.norm.bias,
                                               block.pwconv1.weight, block.pwconv1.bias)
    w2 = (gamma[:, None] * block.pwconv2.weight).detach()
    b2 = (gamma * block.pwconv2.bias).detach()

    def forward(x, state):
        # Contiguous input: from one frame the upsampling conv's output can come back channels-last (its input,
        # the transposed pre-transformer output [B, C, 1], is both layouts), a compiled variant of its own.
        window, residual = fns.convnext_input(x.contiguous(), state.tensors[key], b2)
        d = F.conv1d(window, w_dw, None, groups=groups)
        return _accumulate(residual, w2, fns.convnext_hidden(d, b_dw, ln_w, ln_b, w1, b1).transpose(1, 2))

    return forward


def _final_conv_forward(snake, causal, fns: _CodecConvFns):
    alpha, beta, weight, bias = _weights(snake.alpha, snake.beta, causal.conv.weight, causal.conv.bias)
    key = causal.state_key

    def forward(x, state):
        return F.conv1d(fns.snake_window(x, state.tensors[key], alpha, beta), weight, bias)

    return forward


def _identity(x):
    return x


def _convolutions_routable(codec) -> bool:
    """The routed stages assume the released layout: every causal conv of a residual unit or ConvNeXt with a
    history, kernel-size-1 second convs, transposed convs with k = 2s (one input of history) and a final
    SnakeBeta + causal conv."""
    from tts_backend.qwen3.codec import CausalConv1d, DecoderBlock, SnakeBeta

    for block in codec.decoder[1:-2]:
        if not isinstance(block, DecoderBlock):
            return False
        transposed = block.block[1]
        k, s = transposed.conv.kernel_size[0], transposed.stride
        if transposed.history == 0 or transposed.history * s != k - s or transposed.conv.padding[0] != 0:
            return False
        for unit in block.block[2:]:
            if unit.conv1.history == 0 or unit.conv2.history != 0 or unit.conv2.conv.kernel_size[0] != 1:
                return False
    final_snake, final_conv = codec.decoder[-2], codec.decoder[-1]
    return (isinstance(final_snake, SnakeBeta) and isinstance(final_conv, CausalConv1d) and final_conv.history > 0
            and all(convnext.dwconv.history > 0 and convnext.norm.eps == codec.upsample[0][1].norm.eps
                    for _, convnext in codec.upsample))


def _route_codec_convolutions(codec, compile: bool) -> int:
    """Route the decoder blocks, the ConvNeXt blocks and the final SnakeBeta + conv through the functions
    above (eagerly when not `compile`, which is how the CPU tests check them); returns how many modules were
    routed (0 if the codec's layout is not the one they assume)."""
    if not _convolutions_routable(codec):
        return 0
    _, first_convnext = codec.upsample[0]
    fns = _CodecConvFns(compile, first_convnext.norm.eps)
    count = 0
    for _, convnext in codec.upsample:
        convnext.forward = _convnext_forward(convnext, fns)
        count += 1
    return count + _route_decoder(codec, lambda block: _decoder_block_forward(block, fns),
                                  lambda snake, conv: _final_conv_forward(snake, conv, fns))


def _route_decoder(codec, block_forward, final_conv_forward) -> int:
    """The decoder blocks through `block_forward(block)` and the final SnakeBeta + conv through
    `final_conv_forward(snake, conv)`; returns how many modules were routed."""
    for block in codec.decoder[1:-2]:
        block.forward = block_forward(block)
    # decode_chunk calls decoder[-1](decoder[-2](x)): the final SnakeBeta runs inside the last conv's window.
    final_snake, final_conv = codec.decoder[-2], codec.decoder[-1]
    final_snake.forward = _identity
    final_conv.forward = final_conv_forward(final_snake, final_conv)
    return len(codec.decoder) - 3 + 2


class PerLayerKV:
    """A Talker/predictor KV cache with one tensor per layer (same interface as qwen3.talker.KVCache: `k[i]`,
    `v[i]`, `max_len`), so every layer's cache has identical metadata and one compiled layer serves all."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int, device, dtype):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len

    @classmethod
    def for_stack(cls, cfg, num_slots: int, max_len: int, device, dtype) -> "PerLayerKV":
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim, device, dtype)

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]


def triton_kernels():
    """The Triton decode kernels module, or None where Triton is not installed."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels


def kernels_fit(cfg) -> bool:
    """Whether a stack's shapes suit the Triton decode kernels: power-of-two head halves (at least 16: the
    attention's tl.dot tiles) and query groups (tl.arange), and every matmul width a multiple of 16."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    heads, kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    widths = (cfg.hidden_size, cfg.intermediate_size, heads * head_dim, kv * head_dim)
    return (heads % kv == 0 and pow2(heads // kv) and head_dim % 2 == 0 and pow2(head_dim // 2)
            and head_dim // 2 >= 16 and all(w % 16 == 0 for w in widths))


class FusedStack:
    """A qwen3 DecoderStack's weights, regrouped for `make_layer_fn`; `forward` mirrors `run_layers`.
    With `triton`, `decode` runs one new position per row through the Triton layer kernels (kernels.py)."""

    def __init__(self, stack, compile: bool, triton: bool = False) -> None:
        cfg = stack.cfg
        self.num_heads, self.eps, self.theta = cfg.num_attention_heads, cfg.rms_norm_eps, cfg.rope_theta
        self.kernels = triton_kernels() if triton else None
        if triton and (self.kernels is None or not kernels_fit(cfg)):
            raise ValueError("the Triton decode kernels need Triton and kernel-friendly shapes (see kernels_fit)")
        self.layers = []
        with torch.no_grad():
            for layer in stack.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight.detach(),
                    torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)).detach(),
                    a.q_norm.weight.detach(), a.k_norm.weight.detach(), a.o_proj.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    torch.cat((m.gate_proj.weight, m.up_proj.weight)).detach(), m.down_proj.weight.detach(),
                ))
        self.norm_weight = stack.norm.weight.detach()
        self.layer_fn = _compile(make_layer_fn(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                               cfg.rms_norm_eps, cfg.rope_theta), compile)
        eps = cfg.rms_norm_eps
        # Over rows of any rank, as one 2-D shape: one compiled variant for decode [B, D] and prefill [B, S, D].
        norm = _compile(lambda x, w: _rms_norm(x, w, eps), compile)
        self.norm_fn = lambda x, w: norm(x.reshape(-1, x.shape[-1]), w).view(x.shape)
        self.key_positions = torch.arange(max(cfg.max_position_embeddings, 1), device=self.norm_weight.device)

    def forward(self, x: torch.Tensor, cache: PerLayerKV, slots: torch.Tensor, pos: torch.Tensor,
                attend_len: int, final_norm: bool = True) -> torch.Tensor:
        key_pos = self.key_positions[:attend_length(attend_len, cache.max_len, x.device)]  # see attend_length
        for i, weights in enumerate(self.layers):
            x = self.layer_fn(x, *weights, cache.k[i], cache.v[i], slots, pos, key_pos)
        return self.norm_fn(x, self.norm_weight) if final_norm else x

    def decode(self, x: torch.Tensor, cache: PerLayerKV, rows: torch.Tensor, pos: torch.Tensor,
               final_norm: bool = True, pair_offset: int = 0) -> torch.Tensor:
        """x [B, D], one new position per row at pos [B] of cache rows `rows` [B] -> [B, D]. Attends exactly
        positions 0..pos of each row, so it needs no attended-length bucket. pair_offset: see kernels.attend."""
        for i, weights in enumerate(self.layers):
            x = self.kernels.decode_layer(x, weights, cache.k[i], cache.v[i], rows, pos, self.num_heads, self.eps,
                                          self.theta, pair_offset)
        return self.norm_fn(x, self.norm_weight) if final_norm else x


def residual_sampler(params, compile: bool):
    """Code-predictor draw: temperature -> top-k -> top-p -> Gumbel-max (sampling settings are constants of
    the compiled function, not inputs)."""
    temperature, top_k, top_p = params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p

    def sample(logits, seeds, counters):
        scores = warp(logits.float(), temperature, top_k, top_p)
        return torch.argmax(scores + gumbel_noise(seeds, counters, scores.shape[-1]), dim=-1)

    return _compile(sample, compile)


def talker_sampler(params, compile: bool):
    """The talker's logits pipeline (qwen3.sampling.talker_scores) on per-row state, then a stateless draw."""
    penalty, min_new = params.repetition_penalty, params.min_new_tokens
    do_sample, temperature, top_k, top_p = params.do_sample, params.temperature, params.top_k, params.top_p

    def sample(logits, seen, generated, seeds, draws, suppress, eos_onehot):
        scores = logits.float()
        if penalty != 1.0:
            scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
        block = (generated < min_new)[:, None] & eos_onehot[None]
        scores = scores.masked_fill(block, float("-inf")).masked_fill(suppress, float("-inf"))
        if not do_sample:
            return torch.argmax(scores, dim=-1)
        scores = warp(scores, temperature, top_k, top_p)
        return torch.argmax(scores + gumbel_noise(seeds, draws, scores.shape[-1]), dim=-1)

    return _compile(sample, compile)


def _frame_embeds(c0_embed, residual, tables: list[torch.Tensor]):
    parts = [c0_embed] + [F.embedding(residual[:, i], t) for i, t in enumerate(tables)]
    return torch.stack(parts, dim=1).sum(1)


class FusedCodePredictor:
    """The 15-step residual-codebook loop with fused layers and a compiled sampler: step 0 runs positions 0
    and 1 (talker hidden, C(c0)) together, each later step one new position, as the reference does."""

    def __init__(self, cp, talker, params, compile: bool, triton: bool = False, max_rows: int = 64) -> None:
        self.cp = cp
        self.talker = talker
        self.stack = FusedStack(cp.model, compile, triton)
        self.triton = triton
        # positions[g, :B]: position g for B rows, contiguous (the Triton kernels index it per row).
        groups = cp.cfg.num_code_groups
        self.positions = torch.arange(groups, device=cp.lm_head[0].weight.device)[:, None].repeat(1, max_rows)
        self.proj = cp.small_to_mtp_projection
        self.heads = [h.weight.detach() for h in cp.lm_head]
        self.tables = [t.weight.detach() for t in cp.model.codec_embedding]
        self.params = params
        self.sample_fn = residual_sampler(params, compile)
        self.first_positions = torch.arange(2, device=self.heads[0].device)
        self.embed_fn = _compile(_frame_embeds, compile)
        # The Triton loop's step tail: final norm + lm-head as one kernel, then one kernel that draws the code
        # and fetches the next input from the codebook table already through the input projection (bf16,
        # built once: 15 x 2048 x 1024 for the 1.7B). Top-p < 1 would need a sort per draw: not this path.
        self.fused_tail = triton and params.subtalker_top_p >= 1.0
        if self.fused_tail:
            with torch.no_grad():
                self.next_tables = [self.proj(t).contiguous() for t in self.tables[:-1]]

    def run(self, hidden, c0, cache: PerLayerKV, rows, seeds, counters):
        """hidden [B, D_talker], c0 [B] -> residual codes [B, G-1], frame embedding sum [B, D_talker]."""
        if self.fused_tail:
            return self._run_fused_tail(hidden, c0, cache, rows, seeds, counters)
        B = hidden.shape[0]
        c0_embed = self.talker.embed_codec(c0)
        if self.triton:
            x = None  # step 0 reads hidden and c0_embed

            def hidden_at(x, g):
                if g == 0:
                    return self._paired_first_step(hidden, c0_embed, cache, rows, final_norm=True)
                return self.stack.decode(x, cache, rows, self.positions[g + 1, :B])

            def next_input(embed):
                return self.proj(embed)
        else:
            x = self.proj(torch.stack((hidden, c0_embed), dim=1))  # positions 0 and 1 in one pass, like the reference
            first = self.first_positions[None].expand(B, 2)

            def hidden_at(x, g):
                pos = first if g == 0 else self.positions[g + 1, :B, None]
                return self.stack.forward(x, cache, rows, pos, cache.max_len)[:, -1]

            def next_input(embed):
                return self.proj(embed)[:, None]
        codes = []
        for g, head in enumerate(self.heads):
            if g:
                x = next_input(F.embedding(codes[-1], self.tables[g - 1]))
            logits = F.linear(hidden_at(x, g), head)
            if self.params.subtalker_do_sample:
                codes.append(self.sample_fn(logits, seeds, counters + g))
            else:
                codes.append(torch.argmax(logits.float(), dim=-1))
        residual = torch.stack(codes, dim=1)
        return residual, self.embed_fn(c0_embed, residual, self.tables)

    def _run_fused_tail(self, hidden, c0, cache: PerLayerKV, rows, seeds, counters):
        """`run` on the Triton kernels throughout: per step, the layers (five kernels each), norm + lm-head
        (one), and draw + next input (one), instead of ~10 kernels of norm, head, top-k, noise, argmax,
        embedding and projection."""
        kernels, stack, p = self.stack.kernels, self.stack, self.params
        B = hidden.shape[0]
        c0_embed = self.talker.embed_codec(c0)
        n = len(self.heads)
        residual = torch.empty(B, n, dtype=torch.long, device=hidden.device)
        for g in range(n):
            if g == 0:
                h = self._paired_first_step(hidden, c0_embed, cache, rows, final_norm=False)
            else:
                h = stack.decode(x, cache, rows, self.positions[g + 1, :B], final_norm=False)
            logits = kernels.norm_matmul(h, stack.norm_weight, self.heads[g], stack.eps)
            x = kernels.sample_rows(logits, seeds, counters, g, residual[:, g], p.subtalker_temperature,
                                    p.subtalker_top_k, p.subtalker_do_sample,
                                    self.next_tables[g] if g + 1 < n else None)
        return residual, self.embed_fn(c0_embed, residual, self.tables)

    def _paired_first_step(self, hidden, c0_embed, cache: PerLayerKV, rows, final_norm: bool):
        """Positions 0 (the talker hidden) and 1 (C(c0)) of every row in one paired Triton pass, like the
        reference's two-position first step (rows B..2B attend to rows 0..B of the same launch); returns the
        hidden state at position 1 [B, D]."""
        B = hidden.shape[0]
        pos = torch.cat((self.positions[0, :B], self.positions[1, :B]))
        x = self.proj(torch.cat((hidden, c0_embed)))
        return self.stack.decode(x, cache, torch.cat((rows, rows)), pos, final_norm=final_norm, pair_offset=B)[B:]
