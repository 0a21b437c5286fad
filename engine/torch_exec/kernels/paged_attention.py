"""Attention over the paged KV cache in one Triton launch per layer, and the K/V slot writes.

Layout (engine/torch_exec/stage/model.py): per layer a K and a V pool `[kv_heads, num_blocks,
block_size, head_dim]`; key j of sequence s lives at block `block_tables[s, j // block_size]`,
offset `j % block_size`. A micro-batch is a list of query chunks, `query_start[S + 1]` their rows
in `q [T, heads, head_dim]`: a prefill chunk is `n` queries at the end of a context of
`context_lens[s]` keys (its cached prefix plus itself), a decode is a chunk of one. Query i of a
chunk sees keys `<= context_len - n + i` (causal with the chunk's offset).

`paged_attention` covers the whole micro-batch in one launch, grid `(row tiles, kv_heads)`, the
row tiles of every chunk listed by the host (`inputs.row_tiles`: a decode beside a 2,048-token
chunk gets one program, not the chunk's 224). A program owns BLOCK_M rows of one sequence and
one KV head; rows are (query, head of the GQA group) pairs, query-major, so a decode's group of heads shares each K/V tile it loads (one
program per sequence x KV head covers the group, as vLLM's paged decode kernel does) and a
prefill tile holds BLOCK_M / group queries. Keys are read BLOCK_N at a time straight from the
pools through the block table (a gathered load, no copy), masked past the context and above the
diagonal, with the online softmax of FlashAttention-2 (Dao 2023) in float32. Masked loads never
touch slots past the context, so pools need no zeroing on this path. Tile sizes: BLOCK_N = 64
keys, BLOCK_M = 64 rows for prefill-sized chunks and 16 (tl.dot's minimum) when the longest
chunk's rows fit in 16, i.e. decode-only batches (`inputs.pick_block_m`).

Rows of a padded decode (CUDA-graph buckets) have context 0: their output is 0, and
`write_kv` skips negative slots, so padding neither reads nor writes the pools.

`reference_paged_attention` is the same computation in plain torch, one sequence at a time (tests).
"""
from __future__ import annotations

import math

import torch

from engine.torch_exec.tensors.inputs import pick_block_m, row_tiles

try:  # triton ships with CUDA builds of torch; CPU-only installs may lack it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None
LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per loop step


# Triton specialises a kernel on each pointer argument's 16-byte alignment and each integer's being 1
# or a multiple of 16, and compiles a new variant the first time a combination is seen: ~0.5-1 s on
# an H100 mid-run when the on-disk cache was cold. The index arrays (block tables, query starts,
# contexts, tiles, slots) are views into one packed buffer at data-dependent offsets
# (engine/torch_exec/tensors/inputs.py), so their alignment changes from step to step: all 8 stalls
# of the 1a5c8d9 H100 runs fall on a micro-batch whose key was new once that is counted (the table
# width, `stride_tab`, explained 3). Those are not specialised on alignment, nor the table width on its
# value. The tensors (q, k, v, o and the KV caches) ARE: their alignment is fixed for a run (allocator
# blocks, constant column offsets), and without it the loads of K and V are not vectorised: with every
# pointer unspecialised (c45993e) the kernel took 11.7 of a 17.7 ms decode forward at 128 x 512 on an
# H200 (0.42 ms a layer, 160 GB/s of K/V) and 55 of 95 ms of a 2,048-token prefill
# (measurements/gpu-h200-qwen2.5-7b-2026-11-28/call1/bench_engine.json); 53 us a layer on the H100
# before it (1a5c8d9). One variant per tile size and dtype, compiled at start-up (`compiled_variants`
# counts them; tests/test_no_jit_in_run.py checks none is added by a run: on this split, not yet run on
# a GPU).
NO_ALIGN = dict(do_not_specialize_on_alignment=["tables_ptr", "qstart_ptr", "ctx_ptr", "tile_seq_ptr",
                                                "tile_idx_ptr"])

if HAVE_TRITON:
    @triton.jit(do_not_specialize=["stride_tab"], **NO_ALIGN)
    def _paged_attn_kernel(
            q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, qstart_ptr, ctx_ptr, tile_seq_ptr, tile_idx_ptr,
            sm_scale_log2,
            stride_qt, stride_qh,
            stride_kh, stride_kb, stride_ks,
            stride_vh, stride_vb, stride_vs,
            stride_ot, stride_oh,
            stride_tab,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            IEEE: tl.constexpr):
        seq = tl.load(tile_seq_ptr + tl.program_id(0))
        tile = tl.load(tile_idx_ptr + tl.program_id(0))
        kvh = tl.program_id(1)
        q0 = tl.load(qstart_ptr + seq)
        q_len = tl.load(qstart_ptr + seq + 1) - q0
        ctx = tl.load(ctx_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len * GROUP
        qi = rows // GROUP  # query index inside the chunk
        head = kvh * GROUP + rows % GROUP
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_ptrs = q_ptr + (q0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        qpos = ctx - q_len + qi  # the position of each row's query: it sees keys <= qpos
        # the tile's last query bounds its keys (causal); rows past the chunk see nothing
        last_q = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
        kv_end = tl.minimum(ctx, ctx - q_len + last_q + 1)
        kv_end = tl.where(tile * BLOCK_M < q_len * GROUP, kv_end, 0)  # a tile past its chunk: no work
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh  # int64: pools may pass 2**31 elements
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        for start in range(0, kv_end, BLOCK_N):
            keys = start + offs_n
            key_ok = keys < kv_end
            blk = tl.load(tables_ptr + seq * stride_tab + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            off = keys % BLOCK_SIZE
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks + dims[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:  # float32 caches (and the interpreter): exact float32 products, no TF32
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale_log2
            see = (keys[None, :] <= qpos[:, None]) & key_ok[None, :] & row_ok[:, None]
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs + dims[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                    input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = o_ptr + (q0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_ch, stride_cs,
                         KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        # padding rows (CUDA-graph buckets) have slot -1: nothing is written
        # (the scalar test is broadcast to a block first: the interpreter rejects scalar masks)
        mask = (heads < KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :] & ((heads * 0 + slot) >= 0)[:, None]
        k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        dst = heads.to(tl.int64)[:, None] * stride_ch + tl.maximum(slot, 0) * stride_cs + dims[None, :]
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    """Whether this process's kernels run under Triton's interpreter (TRITON_INTERPRET=1 when
    this module was imported): the only way they run on CPU tensors."""
    return HAVE_TRITON and not isinstance(_paged_attn_kernel, triton.runtime.JITFunction)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None,
                    tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[T, H, d] = softmax(q k^T * scale, causal with each chunk's offset) v, for every chunk.

    q [T, H, d]; k_cache / v_cache [kv_heads, num_blocks, block_size, d] (last dim contiguous);
    block_tables [S, max_blocks]; query_start [S + 1] (rows of chunk s:
    query_start[s]:query_start[s + 1]); context_lens [S] (keys of chunk s, its own queries
    included); index tensors int32 or int64 (the model passes int64, one packed copy). `max_query_len` (a host int, the longest chunk) picks the row tile and
    `tiles` = (sequence, tile index) of each program (`inputs.row_tiles`, built with the batch's
    other indices), so nothing here reads a device value back to the host; without `tiles`
    they are derived from `query_start` here, at the cost of a copy to the host (tests)."""
    T, H, d = q.shape
    kvh, _nb, bs, _ = k_cache.shape
    group = H // kvh
    S = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    block_m = pick_block_m(max_query_len * group)
    # Triton's CPU interpreter multiplies bfloat16 dot operands as raw bits (triton 3.9): on CPU
    # the operands are widened to float32 (after p is rounded to V's dtype, as on GPU)
    ieee = q.dtype == torch.float32 or q.device.type == "cpu"
    if tiles is None:
        tiles = tuple(torch.from_numpy(a).to(q.device)
                      for a in row_tiles(query_start.cpu().numpy(), group, block_m))
    _paged_attn_kernel[(tiles[0].shape[0], kvh)](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, tiles[0], tiles[1],
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=_pow2(d),
        IEEE=ieee,
        # float32 K/V tiles of head_dim 128 take 32 KB each: one stage keeps a float32 launch
        # within the shared memory of GPUs smaller than the H100
        num_warps=4, num_stages=1 if q.dtype == torch.float32 else 2)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, d] into slot `slots[t]` of the pools (slot < 0: skipped), one launch."""
    T, kvh, d = k.shape
    if T == 0:
        return
    kc = k_cache.view(kvh, -1, d)
    vc = v_cache.view(kvh, -1, d)
    assert kc.stride() == vc.stride() and k.stride(-1) == 1 and v.stride(-1) == 1
    _write_kv_kernel[(T,)](k, v, kc, vc, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           kc.stride(0), kc.stride(1), KV_HEADS=kvh, HEAD_DIM=d,
                           BLOCK_H=_pow2(kvh, 1), BLOCK_D=_pow2(d, 1), num_warps=1)


def kv_bytes_read(k_cache: torch.Tensor, context_lens, query_start, group: int) -> int:
    """Bytes of K and V the kernel reads for one call (each row tile re-reads its keys): the
    figure to divide by the kernel's time for its bandwidth against the HBM copy rate."""
    kvh, _nb, _bs, d = k_cache.shape
    ctx = torch.as_tensor(context_lens, dtype=torch.long).cpu()
    qs = torch.as_tensor(query_start, dtype=torch.long).cpu()
    q_len = qs[1:] - qs[:-1]
    block_m = pick_block_m(int(q_len.max()) * group if len(q_len) else 1)
    tiles = (q_len * group + block_m - 1) // block_m
    # tile i of a chunk reads keys up to its last query (causal); summed in closed form per tile
    total = 0
    for c, n, nt in zip(ctx.tolist(), q_len.tolist(), tiles.tolist()):
        for i in range(nt):
            last = min(i * block_m + block_m - 1, n * group - 1) // group
            total += min(c, c - n + last + 1)
    return 2 * total * kvh * d * k_cache.element_size()


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start: torch.Tensor, context_lens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The same as `paged_attention` in plain torch (float32 math), one chunk at a time (tests)."""
    T, H, d = q.shape
    kvh, _nb, bs, _ = k_cache.shape
    group = H // kvh
    out = torch.zeros_like(q)
    qs = query_start.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        r0, r1 = qs[s], qs[s + 1]
        n = r1 - r0
        if n == 0 or ctx == 0:
            continue
        nb = math.ceil(ctx / bs)
        blocks = block_tables[s, :nb].long()
        k = k_cache[:, blocks].reshape(kvh, nb * bs, d)[:, :ctx].float().repeat_interleave(group, 0)
        v = v_cache[:, blocks].reshape(kvh, nb * bs, d)[:, :ctx].float().repeat_interleave(group, 0)
        qq = q[r0:r1].float().transpose(0, 1)  # [H, n, d]
        sc = torch.matmul(qq, k.transpose(1, 2)) * scale  # [H, n, ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        sc = sc.masked_fill(torch.arange(ctx, device=q.device)[None, :] > qpos[:, None], float("-inf"))
        out[r0:r1] = torch.matmul(sc.softmax(-1), v).transpose(0, 1).to(q.dtype)
    return out


def measure_bandwidth(num_seqs: int, context_len: int, query_len: int = 1, *, kv_heads: int = 4, group: int = 7,
                      head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                      device: str = "cuda", iters: int = 20) -> dict:
    """One `paged_attention` launch over `num_seqs` chunks of `query_len` queries at the end of
    `context_len` keys (decodes by default; qwen2.5-7b's attention shape), blocks shuffled across
    the pool: {"seconds", "bytes" (K/V read, `kv_bytes_read`), "GBps"}, for comparing with the
    device's HBM copy rate (testbed bench engine)."""
    nb = -(-context_len // block_size)
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_seqs * nb, generator=g).view(num_seqs, nb).to(device=device, dtype=torch.int32)
    k_cache = torch.randn(kv_heads, num_seqs * nb, block_size, head_dim, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(num_seqs * query_len, kv_heads * group, head_dim, device=device, dtype=dtype)
    qs = torch.arange(0, num_seqs * query_len + 1, query_len, device=device, dtype=torch.int32)
    ctx = torch.full((num_seqs,), context_len, device=device, dtype=torch.int32)
    out = torch.empty_like(q)

    def call():
        paged_attention(q, k_cache, v_cache, tables, qs, ctx, head_dim ** -0.5, query_len, out=out)

    call()  # compile
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        import time

        t0 = time.perf_counter()
        for _ in range(iters):
            call()
        seconds = (time.perf_counter() - t0) / iters
    nbytes = kv_bytes_read(k_cache, ctx, qs, group)
    return {"seconds": seconds, "bytes": nbytes, "GBps": nbytes / seconds / 1e9}
