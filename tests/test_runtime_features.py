"""SiPipe's runtime features and MoLink's paced links on the real engine (executor=torch)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import engine.torch_exec  # noqa: E402,F401
from engine.torch_exec.stage.sampling import Sampler, apply_penalties  # noqa: E402
from engine.torch_exec.stage.transfer import reassemble, split  # noqa: E402


def test_penalties_exactly_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2], [0], [1], [0]], dtype=torch.int32)  # vocab-major [vocab, S]
    seen = torch.tensor([[False], [True], [False], [False]])
    out = apply_penalties(logits.clone(), counts, seen, repetition=2.0, presence=0.5, frequency=0.25)
    expected = torch.tensor([[2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0]])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("method", ["greedy", "random"])
def test_cpu_pool_sharding_equals_inline_sampling(method):
    g = torch.Generator().manual_seed(0)
    kw = dict(method=method, temperature=0.8, top_k=20, top_p=0.9, seed=7, repetition_penalty=1.3,
              presence_penalty=0.2, frequency_penalty=0.1)
    inline = Sampler(50, **kw)
    pool = [Sampler(50, **kw) for _ in range(2)]
    seqs = [3, 4, 7, 10]
    for sid in seqs:
        toks = torch.randint(0, 50, (6,), generator=g).tolist()
        inline.observe_prefill(sid, 0, toks)
        pool[sid % 2].observe_prefill(sid, 0, toks)
    for step in range(12):
        logits = torch.randn(len(seqs), 50, generator=g)
        keys = [(s, 6 + step) for s in seqs]
        a = inline.sample(logits.clone(), keys)
        b = [0] * len(seqs)
        for k, smp in enumerate(pool):
            rows = [i for i, (s, _) in enumerate(keys) if s % 2 == k]
            for i, t in zip(rows, smp.sample(logits[rows].clone(), [keys[i] for i in rows])):
                b[i] = t
        assert a == b
    assert inline.counts[3].sum() == 12  # state updated in place, one count per sampled token


def test_chunks_reassemble_bit_exactly():
    x = torch.randn(37, 19, dtype=torch.bfloat16)
    chunks = split(x, 100)
    assert len(chunks) == -(-x.numel() * 2 // 100)
    y = reassemble(chunks, torch.empty_like(x))
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


FEATURES = ["runtime.cpu_sampling", "runtime.overlap_input_prep", "runtime.structure_aware_transfer"]


def _torch_run(tmp_path, *extra):
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    cfg = compose_spec([
        "executor=torch", "model=tiny-llama", "parallel.pp=2", "policy=sarathi", "workload=synthetic",
        "workload.num_requests=6", "workload.arrival=offline", "workload.input_dist=uniform",
        "workload.input_min=4", "workload.input_max=48", "workload.output_dist=uniform",
        "workload.output_min=2", "workload.output_max=12", "kv.num_blocks=64", "kv.block_size=8",
        f"executor.model_cache_dir={tmp_path.parent / 'models'}", f"output.dir={tmp_path}", *extra])
    res = run_experiment(cfg)
    assert res.error is None, res.error
    return res


def _tokens(res):
    return {r["request_id"]: r.get("output_token_ids") for r in res.requests}


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
def test_greedy_tokens_unchanged_by_every_runtime_switch(tmp_path):
    base = _torch_run(tmp_path / "base", *[f"{f}=false" for f in FEATURES])
    all_on = _torch_run(tmp_path / "on", *[f"{f}=true" for f in FEATURES], "link.bandwidth=1Gbps",
                        "link.latency=1ms", "executor.link_chunk_bytes=4096",
                        "executor.repetition_penalty=1.0")
    assert base.summary["num_finished"] == all_on.summary["num_finished"] == 6
    assert _tokens(base) == _tokens(all_on)
    names = {n for _, n, *_ in all_on.tracer.spans}
    assert "to_samplers" in names and any(t.startswith("sampler") for t, *_ in all_on.tracer.spans)


@pytest.fixture(scope="module")
def baseline_tokens(tmp_path_factory):
    res = _torch_run(tmp_path_factory.mktemp("feat") / "base", *[f"{f}=false" for f in FEATURES])
    assert res.summary["num_finished"] == 6
    return _tokens(res)


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
@pytest.mark.parametrize("feature", FEATURES)
def test_each_runtime_switch_alone_keeps_greedy_tokens(feature, baseline_tokens, tmp_path):
    """Each SiPipe switch on its own (the others off) gives the baseline's greedy tokens."""
    res = _torch_run(tmp_path / "one", *[f"{f}={'true' if f == feature else 'false'}" for f in FEATURES])
    assert res.summary["num_finished"] == 6
    assert _tokens(res) == baseline_tokens


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_greedy_on_the_host_picks_what_torch_argmax_picks(dtype):
    """The host path uses numpy's argmax (10x faster than torch's on CPU): the same token for
    every row, ties to the first index, a NaN taken as the largest, in every dtype."""
    import torch

    from engine.torch_exec.stage.sampling import greedy

    x = torch.randn(64, 32000, generator=torch.Generator().manual_seed(0))
    x[3, 5] = x[3, 7] = float("nan")
    x[4, :] = 1.0
    x[5, 10] = x[5, 20] = float("inf")
    x[6, 100] = x[6, 200] = 50.0
    x = x.to(getattr(torch, dtype))
    expected = x.argmax(dim=-1).tolist()
    assert expected[3:7] == [5, 0, 10, 100]
    assert greedy(x) == expected
    with torch.inference_mode():
        assert greedy(x.clone()) == expected
