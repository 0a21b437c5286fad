"""Piecewise CUDA graphs for mixed and prefill micro-batches (engine/torch_exec/graphs/piecewise.py).

On CPU: the token buckets, the token-level padding, and the runner's pieces driven through CPU
stand-ins for the CUDA graph calls (a "graph" re-runs its piece), with the Triton kernels under
Triton's interpreter: padded batches through the static buffers give the eager forward's logits
and greedy tokens, after larger batches left stale rows behind, with and without the fused kernels.
With CUDA (`gpu`): replays equal the same pieces run without graphs bit for bit, and greedy
float32 tokens equal the eager engine's."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it before triton's first import

from engine.torch_exec.tensors.inputs import host_batch  # noqa: E402
from engine.torch_exec.graphs.piecewise import pad_tokens, piece_sizes, token_bucket  # noqa: E402
from engine.torch_exec.shared.kv_sizing import stage_sizes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_token_buckets():
    sizes = piece_sizes(560)
    assert sizes[:6] == (16, 32, 64, 128, 256, 320) and sizes[-1] == 576
    assert all(b - a == 64 for a, b in zip(sizes[4:], sizes[5:]))
    assert token_bucket(560, sizes) == 576 and token_bucket(400, sizes) == 448 and token_bucket(3, sizes) == 16
    assert token_bucket(577, sizes) == 0 and token_bucket(0, sizes) == 0
    big = piece_sizes(2100)
    assert 2048 in big and big[-1] == 2304 and 2112 not in big  # steps of 256 past 2,048
    assert piece_sizes(16) == (16,) and piece_sizes(17) == (16, 32)
    assert stage_sizes(0)[-1] == 8192 + 256 and stage_sizes(2048)[-1] == 2048 + 256


def test_pad_tokens_pads_only_the_token_level_arrays():
    pre = [(0, 0, 5, True, [3, 1], [5, 6, 7, 8, 9])]
    dec = [(1, 6, [2, 4], 11), (2, 2, [7], 12)]
    hb = host_batch(pre, dec, 4, 2)
    p = pad_tokens(hb, 16)
    assert p.token_ids.tolist() == hb.token_ids.tolist() + [0] * 9
    assert p.positions.tolist() == hb.positions.tolist() + [0] * 9
    assert p.slots.tolist() == hb.slots.tolist() + [-1] * 9
    for name in ("sample_rows", "query_start", "context_lens", "block_tables", "tile_seq", "tile_idx"):
        assert np.array_equal(getattr(p, name), getattr(hb, name)), name
    assert p.max_query_len == hb.max_query_len and p.num_prefills == 1
    with pytest.raises(ValueError, match="does not pad"):
        pad_tokens(hb, 6)


def test_batches_past_the_attention_buffers_run_eagerly():
    """More sequences, table columns or row tiles than the static index buffers hold: no bucket."""
    from types import SimpleNamespace

    from engine.pricing.models import get_model
    from engine.torch_exec.graphs.piecewise import PiecewiseGraphs

    arch = dataclasses.replace(get_model("tiny-llama"), max_position_embeddings=64)
    model = SimpleNamespace(arch=arch, device=torch.device("cpu"), dtype=torch.float32, first=True, block_size=4,
                            num_blocks=100)
    r = PiecewiseGraphs(model, (16, 32))
    r.graphs = {16: [], 32: []}  # as if captured
    assert r.width == 16 and r.max_seqs == 32 and r.max_tiles == 64
    dec = [(i, 10, [i, 50 + i, 80 + i], 5) for i in range(3)]
    assert r.rows_for(host_batch([(9, 0, 20, True, list(range(20, 25)), [3] * 20)], dec, 4)) == 32
    assert r.rows_for(host_batch([], [(0, 70, list(range(18)), 5)], 4)) == 0  # 18 table columns > 16
    assert r.rows_for(host_batch([(9, 0, 40, True, list(range(20, 30)), [3] * 40)], [], 4)) == 0  # 40 tokens
    r.max_seqs = 2
    assert r.rows_for(host_batch([], dec, 4)) == 0


# --- the runner through CPU stand-ins (Triton's interpreter) ------------------------------------------
@pytest.fixture(scope="module")
def tiny(model_cache):
    pytest.importorskip("transformers")
    pytest.importorskip("triton")
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_checkpoint

    return random_checkpoint(get_model("tiny-llama"), 0, model_cache)


def _stage(path, split, fused=False, device=DEV):
    from engine.torch_exec.weights.checkpoint import read_arch
    from engine.torch_exec.stage.model import StageModel

    first_layer, n, first, last = split
    m = StageModel(read_arch(path), first_layer, n, first, last, 64, 4, device=device, attention="triton",
                   fused=fused)
    m.load(path)
    return m


def _cpu_pieces(m, sizes):
    """A PiecewiseGraphs whose CUDA calls are stand-ins: a recorded "graph" re-runs its piece (no
    warm-up: under the interpreter it would only double the test's time)."""
    from engine.torch_exec.graphs.piecewise import PiecewiseGraphs, _Eager

    class CpuPieces(PiecewiseGraphs):
        def _sync(self):
            pass

        def _warm_up(self, fn):
            pass

        def _record(self, fn):
            return _Eager(fn), None

    r = CpuPieces(m, sizes)
    r.capture_all()
    return r


def _prefill(m, g, hidden):
    tables = {i: list(range(8 * i + 7, 8 * i - 1, -1)) for i in range(4)}
    lens = [9, 30, 14, 3]
    pre = [(i, 0, n, True, tables[i], torch.randint(3, 32000, (n,), generator=g).tolist()) for i, n in enumerate(lens)]
    hp = None if hidden is None else torch.randn(sum(lens), m.arch.hidden_size, generator=g).to(DEV)
    return tables, lens, pre, hp


# (first layer, layers, first stage, last stage): a whole one-layer stage, and a last stage taking hidden states
@pytest.mark.parametrize("split, fused", [((0, 1, True, True), False), ((3, 1, False, True), True),
                                          pytest.param((0, 2, True, False), True, marks=pytest.mark.slow)])
def test_pieces_give_the_eager_forward(tiny, split, fused):
    """Mixed batches padded to a token bucket and run piece by piece with the attentions between
    them: the unpadded eager forward's outputs, also after a larger batch left stale rows in the
    buffers; a batch past the largest bucket runs eagerly."""
    torch.set_num_threads(1)
    m = _stage(tiny, split, fused)
    g = torch.Generator().manual_seed(0)
    tables, lens, pre, hp = _prefill(m, g, None if split[2] else True)
    m.forward(m.prepare(pre, []), hp)  # fill the KV (no pieces yet: eager)
    pieces = _cpu_pieces(m, (16, 32))
    batches = [  # (prefill chunks, decodes): 24 tokens (bucket 32), then 7 (bucket 16) over stale rows
        ([(4, 0, 20, True, [40, 41, 42, 43, 44], list(range(100, 120)))],
         [(i, lens[i], tables[i], 11 + i) for i in range(4)]),
        ([(5, 0, 4, False, [50], [7, 8, 9, 10])], [(0, lens[0] + 1, tables[0], 3), (2, lens[2] + 1, tables[2], 4),
                                                    (3, lens[3] + 1, tables[3], 5)]),
    ]
    for k, (p, d) in enumerate(batches):
        n = sum(c[2] for c in p) + len(d)
        h = None if split[2] else torch.randn(n, m.arch.hidden_size, generator=g).to(DEV)
        m.pieces = None
        want = m.forward(m.prepare(p, d), h)
        m.pieces = pieces
        b = m.prepare(p, d)
        assert b.slots.shape[0] == (32, 16)[k] and b.num_tokens == n and pieces.covers(b)
        # the same K/V are written again (same slots, same values): the second forward reads what the first wrote
        got = m.forward(b, h)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert pieces.replays == 2
    big = [(6, 0, 33, True, list(range(55, 64)), list(range(200, 233)))]
    b = m.prepare(big, [])
    assert b.slots.shape[0] == 33 and not pieces.covers(b)
    m.forward(b, None if split[2] else torch.randn(33, m.arch.hidden_size, generator=g).to(DEV))
    assert pieces.replays == 2


# --- on the GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piece_replays_equal_the_pieces_run_eagerly(tiny, dtype):
    """Bit for bit: replaying the captured pieces and running the same pieces without graphs
    (same buffers, same shapes, same kernels), for a mixed batch and a prefill; all buckets
    captured at configure."""
    from engine.torch_exec.weights.checkpoint import read_arch
    from engine.torch_exec.stage.model import StageModel

    m = StageModel(read_arch(tiny), 0, 8, True, True, 256, 4, dtype=dtype, device="cuda", attention="triton")
    m.load(tiny)
    m.configure(cuda_graphs=True, max_tokens=64)
    assert m.pieces is not None and set(m.pieces.graphs) == set(stage_sizes(64))
    assert all(len(p) == 9 for p in m.pieces.graphs.values())
    g = torch.Generator().manual_seed(0)
    tables, lens, pre, _ = _prefill(m, g, None)
    m.forward(m.prepare(pre, []), None)
    assert m.pieces.replays == 1  # 56 tokens: bucket 64
    mixed = ([(4, 0, 20, True, [40, 41, 42, 43, 44], list(range(100, 120)))],
             [(i, lens[i], tables[i], 11 + i) for i in range(4)])
    for p, d in (mixed, ([(5, 0, 300, True, list(range(100, 175)), [7] * 300)], [])):
        b = m.prepare(p, d)
        assert m.pieces.covers(b)
        replayed = m.forward(b, None)
        assert torch.equal(replayed, m.pieces.run(b, None, replay=False))


@pytest.mark.gpu
def test_piecewise_graphs_give_the_eager_tokens_on_cuda(tiny):
    """float32 generation with chunked prefill (mixed batches through the pieces): graphs on and off
    give the same greedy tokens."""
    from engine.core.kv import BlockManager
    from test_torch_model import _generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14, 40)]
    eager, graphed = _stage(tiny, (0, 8, True, True), device="cuda"), _stage(tiny, (0, 8, True, True), device="cuda")
    eager.configure(cuda_graphs=False)
    graphed.configure(cuda_graphs=True, max_tokens=64)
    torch.backends.cuda.matmul.allow_tf32 = False
    a = _generate([eager], prompts, 12, chunk=8, kv=BlockManager(64, 4))
    b = _generate([graphed], prompts, 12, chunk=8, kv=BlockManager(64, 4))
    assert graphed.pieces.replays > 0 and graphed.graphs.replays > 0 and eager.pieces is None
    assert a == b
