"""Triton kernels for one decoder layer at one new position per row (Talker decode, code-predictor steps).

Why: at decode the layers are bound by kernel count, not by bandwidth. Inductor's fused layer still runs
about 15 kernels per layer (norms, three matmuls through cuBLAS, QK-norm + RoPE, cache scatter, cache
gathers, mask, attention, residual adds); a frame runs 28 Talker layers plus 16 x 5 predictor layers, so
~1,300 kernels at ~4 us each. Here a layer is five kernels, each reading its weights once:

  1. `norm_matmul`: RMSNorm of the residual rows (every program recomputes the row statistics, which is
     cheaper than a launch) times the fused q|k|v weight;
  2. `attend`: per (row, KV head): QK-norm, RoPE, the new K/V written into the slot's cache, and attention
     of the group's query heads over positions 0..pos with an online softmax, each block of cached
     positions as two tensor-core matmuls. The loop bound is the row's position read from device memory,
     so one captured graph serves every context length. A paired launch (`pair_offset`) runs two
     consecutive positions of each row at once (the code predictor's first step);
  3. `matmul_residual`: the output projection plus the residual add;
  4. `norm_matmul` with the SiLU(gate) * up epilogue;
  5. `matmul_residual`: the down projection plus the residual add.

Rows are few (a batch bucket, up to 64 per program), so each program covers all rows of a tile of output
columns and the matmul is a weight-streaming GEMV-like loop; tiles are small so that enough programs stream
weights at once.

`sample_rows` ends a code-predictor step: temperature, top-k and the counter-based Gumbel draw of
sampling_noise, and the next step's input fetched from a table already through the input projection.

Rounding follows the PyTorch modules: matmul outputs, normalised activations and RoPE results are rounded to
the activation dtype where the modules round them, so bf16 results stay within bf16 noise of the modules.
On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, fp32), which is how CI checks
them against the modules.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_matmul_kernel(x_ptr, ln_ptr, w_ptr, out_ptr, M, eps,
                        N: tl.constexpr, K: tl.constexpr, SILU_MUL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[M, N] = rmsnorm(x[M, K]) @ w[N, K]^T, or with SILU_MUL: silu(h @ w[:N]^T) * (h @ w[N:2N]^T)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        ln = tl.load(ln_ptr + rk).to(tl.float32)
        h = (ln[None, :] * (x * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_mask[:, None], other=0.0)
        acc += tl.dot(h, tl.trans(w))
        if SILU_MUL:
            w_up = tl.load(w_ptr + (rn[:, None] + N) * K + rk[None, :], mask=n_mask[:, None], other=0.0)
            acc_up += tl.dot(h, tl.trans(w_up))
    if SILU_MUL:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        result = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    else:
        result = acc
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], result.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _matmul_residual_kernel(a_ptr, w_ptr, res_ptr, out_ptr, M,
                            N: tl.constexpr, K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[M, N] = res[M, N] + a[M, K] @ w[N, K]^T (the product rounded first, as the modules add it)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    dtype = a_ptr.dtype.element_ty
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=n_mask[:, None], other=0.0)
        acc += tl.dot(a, tl.trans(w))
    out_mask = m_mask[:, None] & n_mask[None, :]
    result = acc.to(dtype)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=out_mask, other=0.0)
        result = (res.to(tl.float32) + result.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], result, mask=out_mask)


@triton.jit
def _rms_rope(x1, x2, norm_w1, norm_w2, cos, sin, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
    """RMSNorm over heads (rows of x1, x2: each head's two halves) then rotate-half RoPE; rounded like the
    modules (normalised, weighted, then each RoPE product and sum in the activation dtype)."""
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
    x1 = (norm_w1 * (x1 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    x2 = (norm_w2 * (x2 * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype).to(tl.float32), out2.to(dtype).to(tl.float32)


@triton.jit
def _attend_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, pos_ptr, out_ptr,
                   eps, log2_theta, sm_scale, pair_offset,
                   NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_LEN: tl.constexpr,
                   BLOCK_P: tl.constexpr, PAIRED: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    Q_ROWS: tl.constexpr = 16 if GROUP < 16 else GROUP  # tl.dot tiles have at least 16 rows
    HALF: tl.constexpr = HEAD_DIM // 2
    QKV: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM
    dtype = qkv_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    d = tl.arange(0, HALF)
    g = tl.arange(0, Q_ROWS)
    # RoPE angles in fp32 like the modules: inv_freq = theta ** -(2i / head_dim); cos/sin cast to the dtype.
    inv_freq = tl.exp2(-(2.0 * d.to(tl.float32) / HEAD_DIM) * log2_theta)
    angle = pos.to(tl.float32) * inv_freq
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)

    base = qkv_ptr + row * QKV
    k_off = (NUM_HEADS + kv_head) * HEAD_DIM
    v_off = (NUM_HEADS + NUM_KV + kv_head) * HEAD_DIM
    dk = d[None, :]  # the new K/V as one-row tiles [1, HALF]
    kn1 = tl.load(k_norm_ptr + dk).to(tl.float32)
    kn2 = tl.load(k_norm_ptr + HALF + dk).to(tl.float32)
    k1, k2 = _rms_rope(tl.load(base + k_off + dk).to(tl.float32), tl.load(base + k_off + HALF + dk).to(tl.float32),
                       kn1, kn2, cos[None, :], sin[None, :], eps, HEAD_DIM, dtype)
    v1 = tl.load(base + v_off + dk).to(tl.float32)
    v2 = tl.load(base + v_off + HALF + dk).to(tl.float32)
    cache_row = (slot * NUM_KV + kv_head) * CACHE_LEN * HEAD_DIM
    tl.store(k_cache_ptr + cache_row + pos * HEAD_DIM + dk, k1.to(dtype))
    tl.store(k_cache_ptr + cache_row + pos * HEAD_DIM + HALF + dk, k2.to(dtype))
    tl.store(v_cache_ptr + cache_row + pos * HEAD_DIM + dk, v1.to(dtype))
    tl.store(v_cache_ptr + cache_row + pos * HEAD_DIM + HALF + dk, v2.to(dtype))

    # The group's query heads as the rows of a tensor-core tile (padded to 16 rows; padding rows read 0 and
    # are never stored): scores and the weighted values are two small matmuls per block of positions.
    q_heads = kv_head * GROUP + g  # [Q_ROWS]
    q_real = g < GROUP
    q_ptrs = base + q_heads[:, None] * HEAD_DIM + d[None, :]
    qn1 = tl.load(q_norm_ptr + d).to(tl.float32)[None, :]
    qn2 = tl.load(q_norm_ptr + HALF + d).to(tl.float32)[None, :]
    q1, q2 = _rms_rope(tl.load(q_ptrs, mask=q_real[:, None], other=0.0).to(tl.float32),
                       tl.load(q_ptrs + HALF, mask=q_real[:, None], other=0.0).to(tl.float32),
                       qn1, qn2, cos[None, :], sin[None, :], eps, HEAD_DIM, dtype)
    q1_tile = q1.to(dtype)
    q2_tile = q2.to(dtype)

    # Online softmax; the new position comes from registers, earlier ones from the cache (this program wrote
    # the new one, but other threads of it may not see that store yet).
    best = tl.sum(q1 * k1 + q2 * k2, axis=1) * sm_scale  # [Q_ROWS]
    total = tl.full([Q_ROWS], 1.0, dtype=tl.float32)
    acc1 = tl.zeros([Q_ROWS, HALF], dtype=tl.float32) + v1
    acc2 = tl.zeros([Q_ROWS, HALF], dtype=tl.float32) + v2
    cached = pos  # positions read from the cache: [0, cached)
    if PAIRED:
        # Paired launch: row r + pair_offset is the next position of row r's slot, made in this same launch,
        # so its K/V are not in the cache yet: take them from that row of qkv (normalised and rotated here
        # too) as a second register entry. Rows of the first half have none and weigh it zero. A constexpr:
        # unpaired launches (every Talker step) compile none of this.
        has_prev = row >= pair_offset
        prev_base = qkv_ptr + tl.where(has_prev, row - pair_offset, row) * QKV
        prev_angle = tl.where(has_prev, pos - 1, pos).to(tl.float32) * inv_freq
        prev_cos = tl.cos(prev_angle).to(dtype).to(tl.float32)[None, :]
        prev_sin = tl.sin(prev_angle).to(dtype).to(tl.float32)[None, :]
        kp1, kp2 = _rms_rope(tl.load(prev_base + k_off + dk).to(tl.float32),
                             tl.load(prev_base + k_off + HALF + dk).to(tl.float32), kn1, kn2, prev_cos, prev_sin,
                             eps, HEAD_DIM, dtype)
        prev_score = tl.where(has_prev, tl.sum(q1 * kp1 + q2 * kp2, axis=1) * sm_scale, float("-inf"))
        new_best = tl.maximum(best, prev_score)
        scale = tl.exp(best - new_best)
        weight = tl.exp(prev_score - new_best)
        total = total * scale + weight
        acc1 = acc1 * scale[:, None] + weight[:, None] * tl.load(prev_base + v_off + dk).to(tl.float32)
        acc2 = acc2 * scale[:, None] + weight[:, None] * tl.load(prev_base + v_off + HALF + dk).to(tl.float32)
        best = new_best
        cached = tl.where(has_prev, pos - 1, pos)
    p0 = 0
    while p0 < cached:  # a while loop: the bound lives in device memory (the interpreter rejects range(pos))
        p = p0 + tl.arange(0, BLOCK_P)
        p_mask = p < cached
        k_ptrs = k_cache_ptr + cache_row + p[:, None] * HEAD_DIM + d[None, :]
        kb1 = tl.load(k_ptrs, mask=p_mask[:, None], other=0.0)
        kb2 = tl.load(k_ptrs + HALF, mask=p_mask[:, None], other=0.0)
        scores = tl.dot(q1_tile, tl.trans(kb1)) + tl.dot(q2_tile, tl.trans(kb2))  # [Q_ROWS, BLOCK_P] fp32
        scores = tl.where(p_mask[None, :], scores * sm_scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        scale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * scale + tl.sum(weights, axis=1)
        v_ptrs = v_cache_ptr + cache_row + p[:, None] * HEAD_DIM + d[None, :]
        vb1 = tl.load(v_ptrs, mask=p_mask[:, None], other=0.0)
        vb2 = tl.load(v_ptrs + HALF, mask=p_mask[:, None], other=0.0)
        w_tile = weights.to(dtype)
        acc1 = acc1 * scale[:, None] + tl.dot(w_tile, vb1)
        acc2 = acc2 * scale[:, None] + tl.dot(w_tile, vb2)
        best = new_best
        p0 += BLOCK_P
    out_ptrs = out_ptr + row * NUM_HEADS * HEAD_DIM + q_heads[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptrs, (acc1 / total[:, None]).to(dtype), mask=q_real[:, None])
    tl.store(out_ptrs + HALF, (acc2 / total[:, None]).to(dtype), mask=q_real[:, None])


@triton.jit
def _hash32(x):
    """sampling_noise._hash32 on int64 values (every product stays below 2**63)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _sample_rows_kernel(logits_ptr, seeds_ptr, counters_ptr, codes_ptr, table_ptr, next_ptr, temperature,
                        counter_offset, codes_stride, VOCAB: tl.constexpr, TOP_K: tl.constexpr, SAMPLE: tl.constexpr,
                        HAS_NEXT: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """One row per program: temperature -> top-k -> Gumbel-max with sampling_noise's counter-based noise (or
    argmax), the code written to codes[row], and the row of `table` for that code (the next step's input,
    already projected) copied to next[row]."""
    row = tl.program_id(0)
    vocab = tl.arange(0, VOCAB)
    scores = tl.load(logits_ptr + row * VOCAB + vocab).to(tl.float32)
    if SAMPLE:
        scores = scores / temperature
        if TOP_K < VOCAB:
            ranked = tl.sort(scores, descending=True)
            kth = tl.max(tl.where(vocab == TOP_K - 1, ranked, float("-inf")), axis=0)
            scores = tl.where(scores < kth, float("-inf"), scores)
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        counter = tl.load(counters_ptr + row).to(tl.int64) + counter_offset
        key = _hash32((seed & 0xFFFFFFFF) ^ 0x3C6EF372)
        ctr = _hash32((counter * 0x9E37 + key) & 0xFFFFFFFF)
        bits = _hash32(((ctr ^ vocab.to(tl.int64)) * 0x2C1B3C6D + key) & 0xFFFFFFFF)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        scores = scores - tl.log(-tl.log(u))
    code = tl.argmax(scores, axis=0)
    tl.store(codes_ptr + row * codes_stride, code.to(tl.int64))
    if HAS_NEXT:
        for w0 in range(0, WIDTH, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            mask = w < WIDTH
            tl.store(next_ptr + row * WIDTH + w, tl.load(table_ptr + code.to(tl.int64) * WIDTH + w, mask=mask),
                     mask=mask)


# ------------------------------------------------------------------------------------------------ launchers

def _block_m(rows: int) -> int:
    # tl.dot needs at least 16 rows; more than 64 rows per program would spill registers.
    return min(64, max(16, triton.next_power_of_2(rows)))


def _block_k(k: int, widest: int = 128) -> int:
    # The widest power-of-two tile (16..widest) that divides K, so the K loop needs no mask.
    for block in (256, 128, 64, 32, 16):
        if block <= widest and k % block == 0:
            return block
    raise ValueError(f"reduction width {k} is not a multiple of 16")


def default_tiles(n: int, k: int, rows: int = 1, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [M <= 64, K] x [N, K]^T product, from
    bench/kernel_tune.py on an H200 (bench/results/kernel_tune_h200.json). Narrow N tiles keep ~100+
    programs streaming weights at once for the widths of these models; wide K tiles shorten each program's
    dependent loop, which is what a few-row product waits on."""
    if silu_mul:  # two weight tiles per step (gate and up)
        if rows <= 16:
            return 64, _block_k(k, 256), 4, 3
        return (64, _block_k(k), 8, 3) if n > 4096 else (32, _block_k(k), 4, 3)
    return (16 if n <= 2048 else 32), _block_k(k, 256), 4, 3


def _launch_matmul(kernel, tensors, M: int, N: int, K: int, tiles, **constants) -> None:
    block_n, block_k, num_warps, num_stages = tiles or default_tiles(N, K, M, constants.get("SILU_MUL", False))
    block_k = _block_k(K, block_k)
    block_m = _block_m(M)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    kernel[grid](*tensors, M, N=N, K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                 num_warps=num_warps, num_stages=num_stages, **constants)


def norm_matmul(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                silu_mul: bool = False, tiles: tuple | None = None) -> torch.Tensor:
    """x [M, K] -> rmsnorm(x) @ weight^T [M, N]; with silu_mul, weight is [2N, K] (gate rows, then up rows)."""
    M, K = x.shape
    N = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _launch_matmul(_norm_matmul_kernel, (x, norm_weight, weight, out), M, N, K, tiles, eps=eps, SILU_MUL=silu_mul)
    return out


def matmul_residual(a: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                    tiles: tuple | None = None) -> torch.Tensor:
    """a [M, K] -> (residual +) a @ weight^T [M, N]."""
    M, K = a.shape
    N = weight.shape[0]
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    _launch_matmul(_matmul_residual_kernel, (a, weight, residual if residual is not None else out, out), M, N, K,
                   tiles, HAS_RESIDUAL=residual is not None)
    return out


def attend(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, num_heads: int, eps: float,
           theta: float, block_p: int | None = None, num_warps: int | None = None,
           pair_offset: int = 0) -> torch.Tensor:
    """qkv [M, (H + 2 Hkv) Dh] of one new position per row -> attention output [M, H Dh]; writes K/V at
    (slots[i], :, pos[i]) of the caches [slots, Hkv, L, Dh]. With pair_offset P > 0, row i + P holds the
    position after row i's, of the same slot (two positions of each request in one launch)."""
    M = qkv.shape[0]
    _, num_kv, cache_len, head_dim = k_cache.shape
    out = torch.empty(M, num_heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    # Short caches (the code predictor's 16 positions) take one block.
    block_p = block_p or (16 if cache_len <= 16 else 64)
    num_warps = num_warps or 4
    _attend_kernel[(M, num_kv)](qkv, q_norm, k_norm, k_cache, v_cache, slots, pos, out, eps, math.log2(theta),
                                1.0 / math.sqrt(head_dim), int(pair_offset), NUM_HEADS=num_heads, NUM_KV=num_kv,
                                HEAD_DIM=head_dim,
                                CACHE_LEN=cache_len, BLOCK_P=block_p, PAIRED=pair_offset > 0, num_warps=num_warps)
    return out


def decode_layer(x: torch.Tensor, weights: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, pos: torch.Tensor, num_heads: int, eps: float, theta: float,
                 pair_offset: int = 0) -> torch.Tensor:
    """One pre-norm decoder layer for one new position per row: x [M, D] -> [M, D]. `weights` is a
    FusedStack layer tuple (ln1, wqkv, q_norm, k_norm, wo, ln2, wgu, wd); slots, pos [M] int64; pair_offset
    as in `attend`."""
    ln1, wqkv, q_norm, k_norm, wo, ln2, wgu, wd = weights
    qkv = norm_matmul(x, ln1, wqkv, eps)
    attn = attend(qkv, q_norm, k_norm, k_cache, v_cache, slots, pos, num_heads, eps, theta,
                  pair_offset=pair_offset)
    x = matmul_residual(attn, wo, x)
    h = norm_matmul(x, ln2, wgu, eps, silu_mul=True)
    return matmul_residual(h, wd, x)


def sample_rows(logits: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor, counter_offset: int,
                codes: torch.Tensor, temperature: float, top_k: int, sample: bool,
                next_table: torch.Tensor | None = None) -> torch.Tensor | None:
    """Draw one code per row of logits [B, V] into `codes` [B] (a column view is fine) the way
    fused.residual_sampler does with counters + counter_offset (temperature, top-k, Gumbel-max on
    sampling_noise's noise; argmax when not sampling), and return next_table[code] [B, W] (the next step's
    input), or None without a table."""
    B, vocab = logits.shape
    if vocab & (vocab - 1):
        raise ValueError(f"vocabulary {vocab} is not a power of two")
    width = next_table.shape[1] if next_table is not None else 1
    out = torch.empty(B, width, device=logits.device, dtype=next_table.dtype) if next_table is not None else None
    _sample_rows_kernel[(B,)](logits, seeds, counters, codes, next_table if next_table is not None else logits,
                              out if out is not None else logits, float(temperature), int(counter_offset),
                              codes.stride(0), VOCAB=vocab,
                              TOP_K=min(top_k, vocab) if top_k and top_k > 0 else vocab, SAMPLE=sample,
                              HAS_NEXT=next_table is not None, WIDTH=width,
                              BLOCK_W=min(1024, triton.next_power_of_2(width)), num_warps=4)
    return out
