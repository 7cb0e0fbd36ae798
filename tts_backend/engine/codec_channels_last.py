"""The codec's fused convolution stages on channels-last activations (runner option codec_channels_last).

fused.py's `_route_codec_convolutions` keeps the modules' [B, C, T] layout. A GPU profile of one call (16
streams x 12 frames, bf16, H200: bench/results/codec_profile_h200_fused.json, 9.7 ms) spent 1.44 ms in cuDNN's
layout transforms (PyTorch's conv1d makes its input [B, C, T]-contiguous, and cuDNN's bf16 tensor-core kernels
transpose it to NHWC and their output back, at every conv) and 3.3 ms in SnakeBeta kernels running about 5x
below memory bandwidth (the history concatenation falls inside every [B, C, T] row, and the per-channel
parameters are gathered per element).

Here the activations between stages are [B, T, C] tensors, from the pre-transformer's output (already
[B, t, D]) to the final conv, through the same stages as fused.py's:
  * every convolution is a 2-D one over a [B, C, 1, T] view with channels-last strides, with its weight
    converted to channels-last once at routing, so cuDNN runs its NHWC kernels on the tensors as they are and
    its channels-last output is again a [B, T, C] view: no layout or weight copy per call;
  * SnakeBeta, deferred biases, history windows and residuals work on rows of C channels: the history
    concatenation is along T (whole rows), the per-channel parameters broadcast along the last dimension. The
    streaming histories in CodecState keep their [B, C, H] layout (the engine's slot pool and resume depend
    on it) and are read and written transposed inside the compiled functions (they are small);
  * a kernel-size-1 conv plus its residual add is one GEMM (B*T, K) x (K, C) accumulating into the residual.
The routed modules keep their contract, [B, C, T] in and out: what they return is the transposed view of a
[B, T, C] tensor, which the next routed module takes back without a copy (any other [B, C, T] input is made
[B, T, C]-contiguous first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused import _compile, _convolutions_routable, _route_decoder, _snake, _weights, make_convnext_hidden_fn


def _rows(x):
    """A module's [B, C, T] input as [B, T, C] rows (a view when it is what a routed module returned)."""
    return x.transpose(1, 2).contiguous()


def _nhwc(x):
    """[B, T, C] rows as the [B, C, 1, T] channels-last view that cuDNN's NHWC kernels read as it is."""
    return x.unsqueeze(1).permute(0, 3, 1, 2)


def _conv_rows(y):
    """A convolution's [B, C, 1, T] channels-last output as [B, T, C] rows (a view)."""
    return y.permute(0, 2, 3, 1).flatten(1, 2)


def _nhwc_weight(weight):
    """A 1-D (transposed) convolution's weight [A, B, K] as [A, B, 1, K] channels-last, copied once here."""
    return weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)


def _window(x, past):
    """A causal conv's input window [history | x] along T for x [B, T, C]; the history `past` [B, C, H] keeps
    the window's last H rows (in place)."""
    window = torch.cat([past.transpose(1, 2), x], dim=1)
    past.copy_(window[:, window.shape[1] - past.shape[2]:].transpose(1, 2))
    return window


def _snake_rows(x, alpha, beta):
    return _snake(x, torch.exp(alpha), torch.exp(beta))


def _snake_window(x, past, alpha, beta):
    """SnakeBeta(x) written into the window of the causal (or transposed) conv that reads it."""
    return _window(_snake_rows(x, alpha, beta), past)


def _unit_input(x, x_bias, past, alpha, beta, out_bias):
    """A ResidualUnit's input x + x_bias (the deferred bias of the conv that made x, zeros when none): conv1's
    window of SnakeBeta(x), and the residual x + conv2's bias, which conv2's GEMM accumulates into."""
    x = x + x_bias
    return _window(_snake_rows(x, alpha, beta), past), x + out_bias


def _snake_biased(h, bias, alpha, beta):
    """SnakeBeta(h + the producing conv's bias)."""
    return _snake_rows(h + bias, alpha, beta)


def _accumulate(residual, weight_t, x):
    """residual [B, T, C] += x [B, T, K] @ weight_t [K, C]: one GEMM with beta=1 on the residual's own storage
    (a fresh tensor this path owns)."""
    residual.view(-1, residual.shape[-1]).addmm_(x.view(-1, x.shape[-1]), weight_t)
    return residual


class _ChannelsLastFns:
    """The compiled (on CUDA) pieces between the convolutions; one instance serves every stage. ConvNeXt's
    input (its depthwise conv's window and its residual) goes through `unit_input` with a SnakeBeta that is
    exactly the identity (e^beta = inf: x + 0 * sin^2), not a function of its own: every function is one more
    TorchInductor compile at start-up (about 8 s on the H200)."""

    def __init__(self, compile: bool, layer_norm_eps: float) -> None:
        self.snake_window = _compile(_snake_window, compile)
        self.unit_input = _compile(_unit_input, compile)
        self.snake_biased = _compile(_snake_biased, compile)
        self.convnext_hidden = _compile(make_convnext_hidden_fn(layer_norm_eps, channels_last=True), compile)


def _residual_unit_fn(unit, fns: _ChannelsLastFns):
    """ResidualUnit as (x [B, T, C], x_bias, state) -> x + conv2(act2(conv1(act1(x)))), x_bias deferred from
    x's conv."""
    conv1 = unit.conv1.conv
    key, dilation = unit.conv1.state_key, conv1.dilation[0]
    a1, b1, bias1, a2, b2, bias2 = _weights(unit.act1.alpha, unit.act1.beta, conv1.bias, unit.act2.alpha,
                                            unit.act2.beta, unit.conv2.conv.bias)
    w1 = _nhwc_weight(conv1.weight)
    w2 = unit.conv2.conv.weight.detach()[:, :, 0].t()

    def forward(x, x_bias, state):
        window, residual = fns.unit_input(x, x_bias, state.tensors[key], a1, b1, bias2)
        h = _conv_rows(F.conv2d(_nhwc(window), w1, None, dilation=(1, dilation)))
        return _accumulate(residual, w2, fns.snake_biased(h, bias1, a2, b2))

    return forward


def _decoder_block_forward(block, fns: _ChannelsLastFns):
    """DecoderBlock: SnakeBeta into the transposed conv's window, the transposed conv trimming its k - s
    overlap through `padding` (as fused.py's), its bias deferred to the first residual unit's input."""
    snake, transposed = block.block[0], block.block[1]
    stride, key = transposed.stride, transposed.state_key
    alpha, beta, bias = _weights(snake.alpha, snake.beta, transposed.conv.bias)
    weight = _nhwc_weight(transposed.conv.weight)
    padding = (0, transposed.history * stride)
    units = [_residual_unit_fn(unit, fns) for unit in block.block[2:]]
    no_bias = torch.zeros_like(bias)

    def forward(x, state):
        window = fns.snake_window(_rows(x), state.tensors[key], alpha, beta)
        x = _conv_rows(F.conv_transpose2d(_nhwc(window), weight, None, stride=(1, stride), padding=padding))
        x_bias = bias
        for unit in units:
            x, x_bias = unit(x, x_bias, state), no_bias
        return x.transpose(1, 2)

    return forward


def _upsample_forward(transposed):
    """The upsampling stage's transposed conv (k = s: no history, nothing to trim), bias included: its output
    leaves the module, so there is no later function of this module to defer it to."""
    weight, bias, stride = _nhwc_weight(transposed.conv.weight), transposed.conv.bias.detach(), transposed.stride

    def forward(x, state):
        return F.conv_transpose2d(_nhwc(_rows(x)), weight, bias, stride=(1, stride)).squeeze(2)

    return forward


def _convnext_forward(block, fns: _ChannelsLastFns):
    """ConvNeXt with gamma folded into pwconv2 and its residual add as pwconv2's GEMM (as fused.py's)."""
    dw = block.dwconv.conv
    key, groups = block.dwconv.state_key, dw.groups
    w_dw = _nhwc_weight(dw.weight)
    b_dw, ln_w, ln_b, w1, b1 = _weights(dw.bias, block.norm.weight, block.norm.bias, block.pwconv1.weight,
                                        block.pwconv1.bias)
    gamma = block.gamma.detach()
    w2 = (gamma[:, None] * block.pwconv2.weight).detach().t()
    b2 = (gamma * block.pwconv2.bias).detach()
    # Two tensors of zeros, not one passed twice: TorchDynamo guards on arguments aliasing each other, so one
    # tensor in both places would be a variant of its own.
    no_bias, identity_alpha = torch.zeros_like(b2), torch.zeros_like(b2)
    identity_beta = torch.full_like(b2, float("inf"))  # SnakeBeta with e^beta = inf adds exactly 0

    def forward(x, state):
        window, residual = fns.unit_input(_rows(x), no_bias, state.tensors[key], identity_alpha, identity_beta, b2)
        d = _conv_rows(F.conv2d(_nhwc(window), w_dw, None, groups=groups))
        return _accumulate(residual, w2, fns.convnext_hidden(d, b_dw, ln_w, ln_b, w1, b1)).transpose(1, 2)

    return forward


def _causal_conv_forward(causal):
    """The decoder's first conv (no SnakeBeta before it): its window eagerly (a concatenation and a small
    history copy; a compiled function of its own would cost a start-up compile for no fusion), bias included."""
    weight, bias = _nhwc_weight(causal.conv.weight), causal.conv.bias.detach()
    key, dilation = causal.state_key, causal.conv.dilation[0]

    def forward(x, state):
        window = _window(_rows(x), state.tensors[key])
        return F.conv2d(_nhwc(window), weight, bias, dilation=(1, dilation)).squeeze(2)

    return forward


def _final_conv_forward(snake, causal, fns: _ChannelsLastFns):
    alpha, beta, bias = _weights(snake.alpha, snake.beta, causal.conv.bias)
    weight, key, dilation = _nhwc_weight(causal.conv.weight), causal.state_key, causal.conv.dilation[0]

    def forward(x, state):
        window = fns.snake_window(_rows(x), state.tensors[key], alpha, beta)
        return F.conv2d(_nhwc(window), weight, bias, dilation=(1, dilation)).squeeze(2)

    return forward


def _channels_last_routable(codec) -> bool:
    """fused.py's layout, plus what this path routes besides: the upsampling transposed convs without history
    (k = s) and a causal first decoder conv."""
    from tts_backend.qwen3.codec import CausalConv1d

    first = codec.decoder[0]
    return (_convolutions_routable(codec) and isinstance(first, CausalConv1d) and first.history > 0
            and all(transposed.history == 0 and transposed.conv.kernel_size[0] == transposed.stride
                    for transposed, _ in codec.upsample))


def route_codec_convolutions_channels_last(codec, compile: bool) -> int:
    """Route the upsampling stages, the decoder's first conv, its blocks and the final SnakeBeta + conv
    through the functions above (eagerly when not `compile`, which is how the CPU tests check them); returns
    how many modules were routed (0 if the codec's layout is not the one they assume)."""
    if not _channels_last_routable(codec):
        return 0
    _, first_convnext = codec.upsample[0]
    fns = _ChannelsLastFns(compile, first_convnext.norm.eps)
    count = 0
    for transposed, convnext in codec.upsample:
        transposed.forward = _upsample_forward(transposed)
        convnext.forward = _convnext_forward(convnext, fns)
        count += 2
    codec.decoder[0].forward = _causal_conv_forward(codec.decoder[0])
    return count + 1 + _route_decoder(codec, lambda block: _decoder_block_forward(block, fns),
                                      lambda snake, conv: _final_conv_forward(snake, conv, fns))
