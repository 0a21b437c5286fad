"""The paged-attention kernel (engine/torch_exec/kernels/paged_attention.py) against plain torch.

On CPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest
before triton is first imported), so CI checks the kernel's indexing, masking and online softmax
without a GPU; where CUDA is present the same tests run the compiled kernels on it (DEV), and
the `gpu` tests add bfloat16 at qwen2.5-7b's attention shape."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it before triton's first import
triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from engine.torch_exec.kernels.paged_attention import (  # noqa: E402
    kv_bytes_read, measure_bandwidth, paged_attention, reference_paged_attention, write_kv)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layout(chunks, kvh=2, group=2, d=16, bs=4, num_blocks=64, dtype=torch.float32, device=DEV, seed=0):
    """A random paged batch. chunks: [(context_len, query_len)] -- query_len 1 is a decode,
    query_len == context_len a prefill from 0, anything between a chunk after a cached prefix.
    Each sequence's blocks are drawn at random (shuffled tables); pools hold random values
    everywhere, so a read past a context would show."""
    g = torch.Generator().manual_seed(seed)
    S = len(chunks)
    maxb = max(-(-c // bs) for c, _ in chunks)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(S, maxb, dtype=torch.int32)
    used = 0
    for s, (c, _n) in enumerate(chunks):
        nb = -(-c // bs)
        tables[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    assert used <= num_blocks
    qlens = [n for _c, n in chunks]
    qs = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = int(qs[-1])
    q = torch.randn(T, kvh * group, d, generator=g).to(dtype)
    kc = torch.randn(kvh, num_blocks, bs, d, generator=g).to(dtype)
    vc = torch.randn(kvh, num_blocks, bs, d, generator=g).to(dtype)
    ctx = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(kc), to(vc), to(tables), to(qs), to(ctx), max(qlens)


def run_both(chunks, **kw):
    q, kc, vc, tables, qs, ctx, maxq = layout(chunks, **kw)
    scale = q.shape[-1] ** -0.5
    got = paged_attention(q, kc, vc, tables, qs, ctx, scale, maxq)
    ref = reference_paged_attention(q, kc, vc, tables, qs, ctx, scale)
    return got, ref


MIXED = [(9, 9), (13, 5), (1, 1), (7, 1), (16, 1), (21, 3)]  # prefill from 0, prefill after a prefix, decodes


@pytest.mark.parametrize("chunks, kw", [
    (MIXED, {}),
    ([(5, 1), (12, 1), (4, 1), (33, 1)], {"group": 4, "kvh": 1}),  # decode-only, MQA-like
    ([(40, 24)], {"group": 1, "kvh": 3, "d": 32, "bs": 8}),  # long chunk, several row tiles, no GQA
    ([(3, 3), (70, 2)], {"group": 3, "kvh": 2, "d": 8, "bs": 16}),  # group 3, d < 16, partial blocks
    ([(100, 70), (5, 1)], {"group": 2, "kvh": 2, "d": 16, "bs": 8, "num_blocks": 32}),  # 3 row tiles of 64
])
def test_kernel_matches_reference(chunks, kw):
    got, ref = run_both(chunks, **kw)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_kernel_in_half_precision():
    for dtype in (torch.bfloat16, torch.float16):
        got, ref = run_both(MIXED, dtype=dtype)
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_padding_rows_are_inert():
    """CUDA-graph padding: context 0 gives zeros and a slot of -1 writes nothing."""
    q, kc, vc, tables, qs, ctx, _ = layout([(6, 1), (0, 1)])
    out = paged_attention(q, kc, vc, tables, qs, ctx, 0.25, 1)
    assert torch.count_nonzero(out[1]) == 0 and torch.isfinite(out).all()
    k = torch.randn(2, kc.shape[0], kc.shape[-1], device=DEV)
    before = kc.clone()
    write_kv(k, k, kc, vc, torch.tensor([5, -1], dtype=torch.int32, device=DEV))
    changed = (kc != before).any(dim=-1).nonzero().tolist()  # [head, block, offset]
    assert changed == [[h, 1, 1] for h in range(kc.shape[0])]
    torch.testing.assert_close(kc[:, 1, 1], k[0])
    torch.testing.assert_close(vc[:, 1, 1], k[0])


def test_write_kv_matches_index_copy():
    kvh, nb, bs, d = 3, 10, 4, 8
    kc = torch.zeros(kvh, nb, bs, d, device=DEV)
    vc = torch.zeros(kvh, nb, bs, d, device=DEV)
    k = torch.randn(7, kvh, d, device=DEV)
    v = torch.randn(7, kvh, d, device=DEV)
    slots = torch.tensor([0, 5, 6, 13, 39, 22, 1], dtype=torch.int32, device=DEV)
    write_kv(k, v, kc, vc, slots)
    ek, ev = torch.zeros_like(kc), torch.zeros_like(vc)
    ek.view(kvh, -1, d).index_copy_(1, slots.long(), k.transpose(0, 1))
    ev.view(kvh, -1, d).index_copy_(1, slots.long(), v.transpose(0, 1))
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_reference_matches_dense_sdpa():
    """The reference itself against SDPA on contiguous K/V: a prefill after a prefix and a decode."""
    q, kc, vc, tables, qs, ctx, _ = layout([(11, 4), (6, 1)], kvh=2, group=3, d=16, bs=4, device="cpu")
    scale = 0.3
    ref = reference_paged_attention(q, kc, vc, tables, qs, ctx, scale)
    for s, (r0, r1) in enumerate([(0, 4), (4, 5)]):
        c = int(ctx[s])
        nb = -(-c // 4)
        k = kc[:, tables[s, :nb].long()].reshape(2, -1, 16)[:, :c]
        v = vc[:, tables[s, :nb].long()].reshape(2, -1, 16)[:, :c]
        n = r1 - r0
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        o = F.scaled_dot_product_attention(q[r0:r1].transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        torch.testing.assert_close(ref[r0:r1], o[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_a_wrong_table_is_caught():
    """Mutation check: swapping two table entries of one sequence changes the output."""
    q, kc, vc, tables, qs, ctx, maxq = layout(MIXED)
    good = paged_attention(q, kc, vc, tables, qs, ctx, 0.25, maxq)
    bad_tables = tables.clone()
    bad_tables[1, [1, 3]] = bad_tables[1, [3, 1]]  # a full block for the partial last one
    bad = paged_attention(q, kc, vc, bad_tables, qs, ctx, 0.25, maxq)
    assert not torch.allclose(good[9:14], bad[9:14])
    torch.testing.assert_close(good[:9], bad[:9])


def test_kv_bytes_read_counts_causal_tiles():
    kc = torch.zeros(2, 8, 4, 16)
    # two decodes of context 10 and 3: each reads its whole context once, K and V, 2 heads x 16 x 4 B
    assert kv_bytes_read(kc, [10, 3], [0, 1, 2], group=2) == 2 * 13 * 2 * 16 * 4


@pytest.mark.gpu
def test_kernel_matches_reference_on_cuda_bf16():
    chunks = [(700, 700), (900, 128), (1, 1)] + [(c, 1) for c in range(3, 3000, 97)]
    got, ref = run_both(chunks, kvh=4, group=7, d=128, bs=16, num_blocks=4096, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    got, ref = run_both(chunks, kvh=4, group=7, d=128, bs=16, num_blocks=4096, dtype=torch.float32, device="cuda")
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_table_width_compiles_no_new_kernel_variant():
    """Decode batches whose tables are 1, 16, 17 and 32 blocks wide reuse one compiled kernel: a
    specialisation on the table's stride compiled a new variant mid-run (~0.5-1 s each on an H100)."""
    from engine.torch_exec.kernels.paged_attention import _paged_attn_kernel

    def variants() -> int:
        return sum(len(cache[0]) for cache in _paged_attn_kernel.device_caches.values())

    before = None
    for blocks in (1, 16, 17, 32):
        got, ref = run_both([(blocks * 16, 1), (3, 1)], kvh=4, group=7, d=128, bs=16, num_blocks=256,
                            dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
        before = variants() if before is None else before
    assert variants() == before


# --- the model's triton path, end to end (CPU: interpreter) -----------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpts(model_cache):
    pytest.importorskip("transformers")
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_checkpoint

    return {n: random_checkpoint(get_model(n), 0, model_cache) for n in ("tiny-llama", "tiny-qwen2")}


def _stages(path, split, attention, num_blocks=64, block_size=4, device=DEV):
    from engine.torch_exec.weights.checkpoint import read_arch
    from engine.torch_exec.stage.model import StageModel

    arch = read_arch(path)
    out, first = [], 0
    for i, n in enumerate(split):
        m = StageModel(arch, first, n, i == 0, i == len(split) - 1, num_blocks, block_size, device=device,
                       attention=attention)
        m.load(path)
        out.append(m)
        first += n
    return out


# tiny-qwen2 at P=2 (4.5 s of CPU) is a long real-engine case (issue 25 item 15): `./tb test -m slow`
@pytest.mark.parametrize("name, split", [("tiny-llama", [2]), pytest.param("tiny-qwen2", [4, 2], marks=pytest.mark.slow)])
def test_triton_path_gives_the_torch_paths_greedy_tokens(tiny_ckpts, name, split):
    """Chunked prefill (chunks after a cached prefix), batched decodes, P=1 and P=2: the same
    greedy tokens as the torch path, which tests/test_torch_model.py anchors to HF `generate`.
    P=1 is one stage over tiny-llama's first two layers: under Triton's interpreter the kernel
    costs the same per layer, and all eight took 8 s of CPU for no other check."""
    from engine.core.kv import BlockManager
    from test_torch_model import _generate

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14)]
    path = tiny_ckpts[name]
    ref = _generate(_stages(path, split, "torch"), prompts, 6, chunk=5, kv=BlockManager(64, 4))
    got = _generate(_stages(path, split, "triton"), prompts, 6, chunk=5, kv=BlockManager(64, 4))
    assert got == ref
    assert len({t for g_ in got.values() for t in g_}) > 10, "outputs collapsed; the check would be weak"


def test_triton_path_reads_no_unwritten_slot(tiny_ckpts):
    """The triton path never zeroes blocks (masked loads skip them): NaNs in every unwritten
    slot of the pools must not reach the logits."""
    m = _stages(tiny_ckpts["tiny-llama"], [8], "triton")[0]
    for c in m.k_cache + m.v_cache:
        c.fill_(float("nan"))
    b = m.prepare([(0, 0, 5, True, [3, 1], [5, 6, 7, 8, 9])], [])
    assert b.new_blocks is None and b.chunks == []
    out = m.forward(b, None)
    assert torch.isfinite(out).all()
    b = m.prepare([], [(0, 5, [3, 1], 11)])
    assert torch.isfinite(m.forward(b, None)).all()


@pytest.mark.parametrize("full", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)])
def test_engine_with_triton_attention_matches_hf(tiny_ckpts, full):
    """The real engine (spawned stages, P=2, chunked prefill) with executor.attention=triton -- the
    stages run the kernels under Triton's interpreter -- gives HF's greedy tokens. `full` (slow):
    the engine tests' six requests on a pool small enough to force a preemption (recompute into
    recycled blocks, which this path never zeroes)."""
    pytest.importorskip("zmq")
    import test_torch_engine as te
    from engine.core.request import Request

    requests = te._requests()
    if not full:
        requests = [Request(r.request_id, 0.0, r.prompt_len, o, prompt_token_ids=r.prompt_token_ids)
                    for r, o in zip(requests[:3], (5, 4, 6))]
    cache = os.path.dirname(tiny_ckpts["tiny-llama"])
    ctrl, _ex = te._run_pipeline(requests, pp=2, model="tiny-llama", cache=cache, num_blocks=24,
                                 policy_params={"token_budget": 16, "max_num_seqs": 8}, attention="triton")
    assert ctrl.num_finished == len(requests)
    assert max(m.num_prefill_tokens for m in ctrl.records) <= 16 < max(r.prompt_len for r in requests)
    if full:
        assert ctrl.num_preemptions > 0
    ref = te._hf_greedy(tiny_ckpts["tiny-llama"], requests)
    assert {r.request_id: ctrl.sequences[r.request_id].output_token_ids for r in requests} == ref


def test_measure_bandwidth_counts_bytes():
    m = measure_bandwidth(2, 9, kv_heads=1, group=2, head_dim=16, block_size=4, dtype=torch.float32, device=DEV,
                          iters=1)
    assert m["bytes"] == 2 * 2 * 9 * 1 * 16 * 4 and m["seconds"] > 0 and m["GBps"] > 0


@pytest.mark.gpu
def test_measure_bandwidth_on_cuda():
    m = measure_bandwidth(128, 512)
    print(f"decode 128 x 512, qwen2.5-7b attention shape, bf16: {m['seconds'] * 1e6:.1f} us, {m['GBps']:.0f} GB/s")
    assert m["GBps"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("pp", [1, 2])
def test_engine_on_cuda_matches_hf(tiny_ckpts, pp):
    """executor.device=cuda in float32 with the defaults there (triton attention, fused kernels, CUDA
    graphs): HF's greedy tokens, with chunked prefill and a forced preemption. The stages load HF's
    checkpoint (`model_path`): a table model on CUDA draws its random weights on the GPU instead, and
    CUDA's default dtype is bf16, either of which changes every token (both seen on an H100)."""
    pytest.importorskip("zmq")
    import test_torch_engine as te

    requests = te._requests()
    path = tiny_ckpts["tiny-llama"]
    ctrl, _ex = te._run_pipeline(requests, pp=pp, model="tiny-llama", cache=os.path.dirname(path), num_blocks=24,
                                 policy_params={"token_budget": 16, "max_num_seqs": 8}, device="cuda",
                                 model_path=path, dtype="float32")
    assert ctrl.num_finished == len(requests) and ctrl.num_preemptions > 0
    ref = te._hf_greedy(tiny_ckpts["tiny-llama"], requests)
    assert {r.request_id: ctrl.sequences[r.request_id].output_token_ids for r in requests} == ref


def test_only_the_index_arrays_lose_their_alignment_specialisation():
    """The index arrays move inside one packed buffer from step to step (a new Triton variant each
    time their alignment flips); q, k, v, o and the caches do not, and unspecialised they are not
    loaded vectorised: the kernel ran 8x slower on an H200 with every pointer unspecialised."""
    from engine.torch_exec.kernels.paged_attention import NO_ALIGN

    unspecialised = set(NO_ALIGN["do_not_specialize_on_alignment"])
    assert unspecialised == {"tables_ptr", "qstart_ptr", "ctx_ptr", "tile_seq_ptr", "tile_idx_ptr"}
