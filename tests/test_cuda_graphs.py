"""CUDA graphs for decode-only micro-batches (engine/torch_exec/graphs/cuda_graphs.py) and the vectorised
batch indices they pad (engine/torch_exec/tensors/inputs.py).

On CPU: the bucketing and padding functions, the numpy index builder against a per-token
reference, and the graph runner's static buffers driven eagerly (padding rows and stale buffer
contents must not change the real rows). With CUDA (`gpu`): replaying the graphs gives the eager
forward's tokens, and greedy tokens match Hugging Face's `generate`."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.torch_exec.tensors.inputs import host_batch, pad_rows  # noqa: E402
from engine.torch_exec.graphs.cuda_graphs import GRAPH_SIZES, bucket, graph_rows, graph_width  # noqa: E402


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 250, 256)] == [1, 2, 4, 8, 8, 16, 16, 32, 256, 256]
    assert bucket(257) == 0 and bucket(0) == 0
    assert GRAPH_SIZES[:5] == (1, 2, 4, 8, 16) and GRAPH_SIZES[-1] == 256
    assert bucket(5, (3, 6)) == 6
    assert graph_width(2048, 16, 10_000) == 128 and graph_width(2048, 16, 100) == 100
    assert graph_width(None, 16, 100) == 100 and graph_width(2050, 16, 10_000) == 129


def _random_rows(rng, num_prefills, num_decodes, bs):
    """Driver-style rows with distinct random blocks (tables may run past the context)."""
    pool = list(range(1000))
    rng.shuffle(pool)
    pre, dec = [], []
    for i in range(num_prefills):
        start, n = rng.choice([0, rng.randrange(1, 30)]), rng.randrange(1, 20)
        nb = -(-(start + n) // bs) + rng.randrange(0, 2)
        table = [pool.pop() for _ in range(nb)]
        pre.append((i, start, n, rng.random() < 0.7, table, [rng.randrange(3, 999) for _ in range(n)]))
    for i in range(num_decodes):
        pos = rng.randrange(0, 50)
        table = [pool.pop() for _ in range(pos // bs + 1 + rng.randrange(0, 2))]
        dec.append((100 + i, pos, table, rng.randrange(3, 999)))
    return pre, dec


def _naive(pre, dec, bs):
    """The per-token construction the vectorised builder replaced."""
    ids, pos, slots, rows, qs, ctx, tables = [], [], [], [], [0], [], []
    for _sid, start, n, samples, table, toks in pre:
        for p in range(start, start + n):
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        ids.extend(toks)
        qs.append(qs[-1] + n)
        ctx.append(start + n)
        tables.append(table[:-(-(start + n) // bs)])
        if samples:
            rows.append(qs[-1] - 1)
    for _sid, p, table, tok in dec:
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        ids.append(tok)
        rows.append(qs[-1])
        qs.append(qs[-1] + 1)
        ctx.append(p + 1)
        tables.append(table[:p // bs + 1])
    return ids, pos, slots, rows, qs, ctx, tables


@pytest.mark.parametrize("seed", range(6))
def test_host_batch_matches_a_per_token_build(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    pre, dec = _random_rows(rng, rng.randrange(0, 4), rng.randrange(0 if seed else 1, 9), bs)
    if not pre and not dec:
        dec = _random_rows(rng, 0, 1, bs)[1]
    group = rng.choice([1, 3, 7])
    hb = host_batch(pre, dec, bs, group)
    ids, pos, slots, rows, qs, ctx, tables = _naive(pre, dec, bs)
    bm = 16 if max(np.diff(qs)) * group <= 16 else 64
    tiles = [(s, i) for s in range(len(ctx)) for i in range(-(-(qs[s + 1] - qs[s]) * group // bm))]
    assert list(zip(hb.tile_seq.tolist(), hb.tile_idx.tolist())) == tiles
    assert hb.token_ids.tolist() == ids and hb.positions.tolist() == pos and hb.slots.tolist() == slots
    assert hb.sample_rows.tolist() == rows and hb.query_start.tolist() == qs and hb.context_lens.tolist() == ctx
    assert hb.num_prefills == len(pre) and hb.max_query_len == max(np.diff(qs))
    for row, t in zip(hb.block_tables.tolist(), tables):
        assert row[:len(t)] == t and set(row[len(t):]) <= {t[0]}  # padded with its first block


def test_padding_and_eligibility():
    pre, dec = _random_rows(random.Random(1), 1, 5, 4)
    assert graph_rows(host_batch(pre, dec, 4), 1000) == 0  # mixed: eager
    hb = host_batch([], dec, 4)
    assert graph_rows(hb, 1000) == 8
    assert graph_rows(hb, hb.block_tables.shape[1] - 1) == 0  # wider than the graphs' tables
    p = pad_rows(hb, 8)
    assert p.slots.tolist()[:5] == hb.slots.tolist() and p.slots.tolist()[5:] == [-1] * 3
    assert p.context_lens.tolist()[5:] == [0] * 3 and p.query_start.tolist() == list(range(9))
    assert p.sample_rows.tolist() == list(range(8)) and p.block_tables.shape == (8, hb.block_tables.shape[1])
    assert p.tile_seq.tolist() == list(range(8)) and p.tile_idx.tolist() == [0] * 8
    with pytest.raises(ValueError):
        pad_rows(host_batch(pre, dec, 4), 8)


# --- the runner's static buffers, driven eagerly (CPU: Triton interpreter) ------------------------
@pytest.fixture(scope="module")
def tiny(model_cache):
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest sets it before triton's first import
    pytest.importorskip("triton")
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_checkpoint

    return random_checkpoint(get_model("tiny-llama"), 0, model_cache)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernels under Triton's interpreter


def _model(path, split=(0, 8, True, True), device=DEV, attention="triton", dtype="float32"):
    from engine.torch_exec.weights.checkpoint import read_arch
    from engine.torch_exec.stage.model import StageModel

    first_layer, n, first, last = split
    m = StageModel(read_arch(path), first_layer, n, first, last, 64, 4, dtype=dtype, device=device,
                   attention=attention)
    m.load(path)
    return m


# (first layer, layers, first stage, last stage); the first split is one stage of two layers: under Triton's
# interpreter each layer's kernels cost the same, and all eight took 7.8 s of CPU for no other check
@pytest.mark.parametrize("split", [(0, 2, True, True), pytest.param((4, 4, False, True), marks=pytest.mark.slow),
                                   pytest.param((0, 4, True, False), marks=pytest.mark.slow)])
def test_static_buffers_give_the_unpadded_rows(tiny, split):
    """The graph runner's buffers, loaded with a padded batch and run eagerly, reproduce the
    unpadded forward's rows -- after a wider batch left stale rows and columns behind."""
    from engine.torch_exec.graphs.cuda_graphs import CudaGraphRunner

    torch.set_num_threads(1)
    m = _model(tiny, split)
    runner = CudaGraphRunner(m, sizes=(4, 8))
    g = torch.Generator().manual_seed(0)
    # fill a few sequences' KV with a prefill first (contexts 9..30 over shuffled tables)
    tables = {i: list(range(8 * i + 7, 8 * i - 1, -1)) for i in range(7)}
    tables[0] = [0] + tables[0][:-1]  # slot 0 holds a real key: a padding row writing there would show
    lens = [9, 30, 14, 3, 22, 17, 5]
    pre = [(i, 0, n, True, tables[i], torch.randint(3, 32000, (n,), generator=g).tolist()) for i, n in enumerate(lens)]
    hp = None if split[2] else torch.randn(sum(lens), m.arch.hidden_size, generator=g).to(DEV)
    m.forward(m.prepare(pre, []), hp)
    for batch in (range(7), [3, 0, 5]):  # bucket 8, then bucket 4 over stale buffers
        dec = [(i, lens[i], tables[i], 11 + i) for i in batch]
        hd = None if split[2] else torch.randn(len(dec), m.arch.hidden_size, generator=g).to(DEV)
        want = m.forward(m.prepare([], dec), hd)
        hb = host_batch([], dec, 4)
        rows = graph_rows(hb, runner.width, runner.sizes)
        assert rows == (8 if len(dec) > 4 else 4)
        b = m.prepare([], dec)
        out = runner.run_eagerly(_padded(m, dec, rows), hd)
        # (matmuls over 8 rows instead of 7 round differently: float32 noise, not a wrong row)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        assert b.graph_rows == 0  # no graphs were captured: prepare leaves batches unpadded


class _FakeGraph:
    """Stands in for a CUDA graph on CPU: replay re-runs the captured function into its output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        self.out.copy_(self.fn())


def _cpu_runner(m, sizes):
    from engine.torch_exec.graphs.cuda_graphs import CudaGraphRunner

    class CpuRunner(CudaGraphRunner):
        def _sync(self):
            pass

        def _warm_up(self, fn):
            fn()

        def _record(self, fn):
            out = fn()
            return _FakeGraph(fn, out), out

    r = CpuRunner(m, sizes=sizes)
    r.capture_all()
    return r


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
@pytest.mark.parametrize("pieces", [False, True])
def test_runner_plumbing_gives_the_eager_tokens(tiny, pieces):
    """capture_all / prepare's padding / replay / the head after it, with CPU stand-ins for the
    CUDA graph calls: P=2, chunked prefill, decode batches of 1-4 in buckets (1, 2, 4) -- the
    same greedy tokens as without graphs; with `pieces`, the mixed and prefill batches also run
    through piecewise graphs of 16 and 32 tokens (engine/torch_exec/graphs/piecewise.py)."""
    from engine.core.kv import BlockManager
    from test_piecewise import _cpu_pieces
    from test_torch_model import _generate

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14)]
    plain = [_model(tiny, (0, 3, True, False)), _model(tiny, (3, 5, False, True))]
    graphed = [_model(tiny, (0, 3, True, False)), _model(tiny, (3, 5, False, True))]
    for m in graphed:
        m.graphs = _cpu_runner(m, (1, 2, 4))
        m.pieces = _cpu_pieces(m, (16, 32)) if pieces else None
    want = _generate(plain, prompts, 5, chunk=8, kv=BlockManager(64, 4))
    got = _generate(graphed, prompts, 5, chunk=8, kv=BlockManager(64, 4))
    assert all(m.graphs.replays > 0 and (not pieces or m.pieces.replays > 0) for m in graphed)
    assert got == want


def _padded(m, dec, rows):
    """What `prepare` builds when a graph of `rows` rows exists."""
    class _Graphs:
        def rows_for(self, hb):
            return rows

    m.graphs = _Graphs()
    try:
        return m.prepare([], dec)
    finally:
        m.graphs = None


# --- on the GPU --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_the_same_batch_run_eagerly(tiny, dtype):
    """Bit for bit: a replay and the eager forward over the same padded buffers (same shapes, same
    kernels), for buckets 1, 4 and 8, after a prefill filled the KV."""
    m = _model(tiny, device="cuda", dtype=dtype)
    m.configure(cuda_graphs=True, max_tokens=64)  # pieces up to 64 + 256 tokens: fewer captures
    assert m.graphs is not None and set(m.graphs.graphs) == set(GRAPH_SIZES)
    g = torch.Generator().manual_seed(0)
    tables = {i: list(range(8 * i, 8 * i + 8)) for i in range(7)}
    lens = [9, 30, 14, 3, 22, 17, 5]
    pre = [(i, 0, n, True, tables[i], torch.randint(3, 32000, (n,), generator=g).tolist()) for i, n in enumerate(lens)]
    m.forward(m.prepare(pre, []), None)
    for batch in ([2], [3, 0, 5], range(7)):
        b = m.prepare([], [(i, lens[i], tables[i], 11 + i) for i in batch])
        assert b.graph_rows == bucket(len(batch))
        replayed = m.forward(b, None)
        eager = m.graphs.run_eagerly(b, None)
        assert torch.equal(replayed, eager)
    assert m.graphs.replays == 3


@pytest.mark.gpu
def test_graph_replay_gives_the_eager_tokens(tiny):
    """float32 generation (chunked prefill, decodes of 1-5 sequences): graphs on and off agree."""
    from engine.core.kv import BlockManager
    from test_torch_model import _generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14, 40)]
    eager = _model(tiny, device="cuda")
    eager.configure(cuda_graphs=False)
    graphed = _model(tiny, device="cuda")
    graphed.configure(cuda_graphs=True, max_tokens=64)
    a = _generate([eager], prompts, 12, chunk=8, kv=BlockManager(64, 4))
    b = _generate([graphed], prompts, 12, chunk=8, kv=BlockManager(64, 4))
    assert graphed.graphs.replays > 0 and eager.graphs is None
    assert a == b


@pytest.mark.gpu
def test_greedy_tokens_match_hf_on_cuda(tiny):
    """float32 on CUDA, triton attention and CUDA graphs, P=2 in one process: HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    from engine.core.kv import BlockManager
    from test_torch_model import _generate

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14)]
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = {}
    for i, p in enumerate(prompts):
        out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=9, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        ref[i] = out[0, len(p):].tolist()
    stages = [_model(tiny, (0, 3, True, False), device="cuda"), _model(tiny, (3, 5, False, True), device="cuda")]
    for s in stages:
        s.configure(cuda_graphs=True, max_tokens=64)
    got = _generate(stages, prompts, 9, chunk=5, kv=BlockManager(64, 4))
    assert got == ref
