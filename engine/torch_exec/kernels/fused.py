"""Fused elementwise kernels of the decode path (Triton), and the unfused torch code they replace.

On an H100 (qwen2.5-7b shape, bf16, decode 128 x 512 from its CUDA graph) the profiler put
~2.4 ms of a 10.3 ms forward into ~30 small kernels a layer around the GEMMs and the attention:
RMSNorm's float32 reduce (cast, pow, mean, add, rsqrt, mul, cast, mul), RoPE's slice/neg/cat and
four multiplies and adds for q and k, SiLU and the multiply by up, the residual adds, and the
K/V write. Each is a full pass over HBM of its operands. Here they are three kernels a norm or
projection pair (vLLM's `fused_add_rms_norm`, `rotary_embedding` + `reshape_and_cache` and
`silu_and_mul` do the same fusions):

- `add_rms_norm(x, residual, w, eps)`: the residual add and the next RMSNorm in one pass, one
  program per row: residual' = x + residual (rounded to the model's dtype, as torch's add is),
  h = w * (residual' * rsqrt(mean(residual'^2) + eps)) with the mean in float32, the normalised
  value rounded to the model's dtype before the weight, as transformers' Llama/Qwen2 RMSNorm
  does. residual' is written over `x` (a projection's fresh output) unless `residual_out` is
  given, so no input the caller still holds is modified;
- `rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)`: RoPE on q in place (or into
  `q_out`) and on k, and k and v stored into their pool slots, one program per token (slot < 0:
  a CUDA-graph padding row, nothing written). The rotated k is only ever read from the pool,
  so it is never written back to `k`;
- `silu_mul(gate, up)`: SiLU(gate) * up.

Every product, sum and cast rounds where the torch code rounds (products in float32, then the
model's dtype), so bf16 results differ from the unfused path only where the GPU's exp / rsqrt
and the order of the float32 sum of squares differ. float32 results agree to rounding (greedy
tokens on CPU still equal Hugging Face's: the CPU path keeps the torch code, and the tests run
these kernels under Triton's interpreter against it).

`reference_*` are the unfused torch computations (what `StageModel` runs when unfused).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.torch_exec.kernels.paged_attention import HAVE_TRITON, _pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # no alignment specialisation on any pointer, no value specialisation on a data-dependent size:
    # one variant per dtype, compiled at start-up (engine/torch_exec/kernels/paged_attention.py)
    @triton.jit(do_not_specialize_on_alignment=["x_ptr", "r_ptr", "w_ptr", "h_ptr", "ro_ptr"])
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, ro_ptr, stride_x, stride_r, stride_h, stride_ro,
                             N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
            s = (x + r).to(ro_ptr.dtype.element_ty)
            tl.store(ro_ptr + row * stride_ro + cols, s, mask=ok)
            x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / N
        y = (x * tl.rsqrt(var + eps)).to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * stride_h + cols, (w * y).to(h_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate(x1, x2, c, s, like_ptr):
        """(x1 * c - x2 * s, x2 * c + x1 * s), each product and sum rounded to the dtype `like_ptr`
        points to, as torch's `x * cos + cat(-x2, x1) * sin` rounds them."""
        dt = like_ptr.dtype.element_ty
        a = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
        b = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
        return a.to(dt), b.to(dt)

    @triton.jit(do_not_specialize_on_alignment=["q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr",
                                                "slots_ptr", "qo_ptr"])
    def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slots_ptr, qo_ptr,
                              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cos, stride_sin, stride_qot, stride_qoh, stride_ch, stride_cs,
                              HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        dt = q_ptr.dtype.element_ty
        j = tl.arange(0, BLOCK_HALF)
        j_ok = j < HALF
        # cos/sin are float32 tables [T, head_dim] (both halves equal): rounded to the model's dtype first
        c = tl.load(cos_ptr + t * stride_cos + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * stride_sin + j, mask=j_ok, other=0.0).to(dt).to(tl.float32)[None, :]
        h = tl.arange(0, BLOCK_H)
        qm = (h < HEADS)[:, None] & j_ok[None, :]
        qp = q_ptr + t * stride_qt + h[:, None] * stride_qh + j[None, :]
        q1 = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
        q2 = tl.load(qp + HALF, mask=qm, other=0.0).to(tl.float32)
        a, b = _rotate(q1, q2, c, s, q_ptr)
        op = qo_ptr + t * stride_qot + h[:, None] * stride_qoh + j[None, :]
        tl.store(op, a, mask=qm)
        tl.store(op + HALF, b, mask=qm)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        kh = tl.arange(0, BLOCK_KV)
        # padding rows (CUDA-graph buckets) have slot -1: nothing is written
        # (the scalar test is broadcast to a block first: the interpreter rejects scalar masks)
        km = (kh < KV_HEADS)[:, None] & j_ok[None, :] & ((kh * 0 + slot) >= 0)[:, None]
        kp = k_ptr + t * stride_kt + kh[:, None] * stride_kh + j[None, :]
        k1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=km, other=0.0).to(tl.float32)
        a, b = _rotate(k1, k2, c, s, q_ptr)
        dst = kh.to(tl.int64)[:, None] * stride_ch + tl.maximum(slot, 0) * stride_cs + j[None, :]
        tl.store(kc_ptr + dst, a.to(kc_ptr.dtype.element_ty), mask=km)
        tl.store(kc_ptr + dst + HALF, b.to(kc_ptr.dtype.element_ty), mask=km)
        vp = v_ptr + t * stride_vt + kh[:, None] * stride_vh + j[None, :]
        tl.store(vc_ptr + dst, tl.load(vp, mask=km).to(vc_ptr.dtype.element_ty), mask=km)
        tl.store(vc_ptr + dst + HALF, tl.load(vp + HALF, mask=km).to(vc_ptr.dtype.element_ty), mask=km)

    @triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["g_ptr", "u_ptr", "o_ptr"])
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        dt = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds to the dtype before the product
        tl.store(o_ptr + offs, (act * u).to(dt), mask=ok)


SILU_BLOCK = 1024


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                 residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, residual') for x [T, N]: residual' = x + residual written over `x` (or into
    `residual_out`), h its RMSNorm times w; with residual None, h = RMSNorm(x) and residual' = x."""
    T, N = x.shape
    h = torch.empty_like(x)
    if residual is None and residual_out is not None:
        x = residual_out.copy_(x)  # the stream starts here: a CUDA-graph piece keeps it in its buffer
    ro = x if residual_out is None else residual_out
    if T == 0:
        return h, ro
    r = x if residual is None else residual
    assert x.stride(-1) == 1 and r.stride(-1) == 1 and ro.stride(-1) == 1
    _add_rms_norm_kernel[(T,)](x, r, w, h, ro, x.stride(0), r.stride(0), h.stride(0), ro.stride(0), N, eps,
                               HAS_RESIDUAL=residual is not None, BLOCK=_pow2(N, 1), num_warps=_warps(N))
    return h, ro


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  q_out: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE on q [T, H, d] (in place, or into q_out) and on k [T, kv_heads, d], k and v stored at
    `slots` of the pools [kv_heads, num_blocks, block_size, d]; cos/sin float32 [T, d]. Returns q."""
    T, H, d = q.shape
    kvh = k.shape[1]
    qo = q if q_out is None else q_out
    if T == 0:
        return qo
    kc = k_cache.view(kvh, -1, d)
    vc = v_cache.view(kvh, -1, d)
    assert kc.stride() == vc.stride() and d % 2 == 0
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == qo.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    _rope_write_kv_kernel[(T,)](
        q, k, v, cos, sin, kc, vc, slots, qo,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), qo.stride(0), qo.stride(1), kc.stride(0), kc.stride(1),
        HEADS=H, KV_HEADS=kvh, HALF=d // 2, BLOCK_H=_pow2(H, 1), BLOCK_KV=_pow2(kvh, 1),
        BLOCK_HALF=_pow2(d // 2, 1), num_warps=4)
    return qo


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise (both contiguous, one shape)."""
    assert gate.shape == up.shape and gate.is_contiguous() and up.is_contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, SILU_BLOCK),)](gate, up, out, n, BLOCK=SILU_BLOCK, num_warps=4)
    return out


def _warps(n: int) -> int:
    """Warps of a row program: 4 up to 2,048 columns, 8 beyond (a 3,584-wide row in one program)."""
    return 4 if n <= 2048 else 8


# --- the unfused torch code (CPU path, tests) ---------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm: float32 mean of squares, normalised value in x's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, 1, d] already in x's dtype."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def reference_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` unfused (x is not modified)."""
    res = x if residual is None else x + residual
    return rms_norm(res, w, eps), res


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
