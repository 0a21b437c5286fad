"""The sampler's top-k-first path keeps vLLM's distribution (top-k, then top-p on what remains):
the same candidates and probabilities as the full-vocabulary mask-and-sort it replaced."""
import torch

from engine.torch_exec.stage.sampling import candidate_probs, greedy, sample


def _old_probs(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The replaced path: threshold top-k over the vocabulary, then top-p by a full sort."""
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(dim=-1)


def _dense(probs: torch.Tensor, cand, vocab: int) -> torch.Tensor:
    return probs if cand is None else torch.zeros(probs.shape[0], vocab).scatter(-1, cand, probs)


def test_topk_first_keeps_the_candidates_and_probabilities():
    gen = torch.Generator().manual_seed(7)
    for vocab, top_k, top_p in [(1000, 50, 0.95), (1000, 50, 0.3), (500, 5, 1.0), (500, 0, 0.9), (64, 64, 0.8),
                                (300, 1, 0.5)]:
        x = torch.randn(6, vocab, generator=gen) * 3
        probs, cand = candidate_probs(x, top_k=top_k, top_p=top_p)
        new, old = _dense(probs, cand, vocab), _old_probs(x, top_k, top_p)
        assert torch.equal(new > 0, old > 0), (vocab, top_k, top_p)  # the same kept tokens
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-7)
        probs, cand = candidate_probs(x, temperature=0.7, top_k=top_k, top_p=top_p)
        torch.testing.assert_close(_dense(probs, cand, vocab), _old_probs(x / 0.7, top_k, top_p), rtol=1e-5, atol=1e-7)


def test_draws_follow_the_filtered_distribution():
    vocab, n = 40, 6000
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 2
    want = _old_probs(x / 0.8, 10, 0.9)[0]
    rows = x.expand(n, vocab).contiguous()
    toks = sample(rows, [(0, pos) for pos in range(n)], method="random", temperature=0.8, top_k=10, top_p=0.9,
                  seed=11)
    freq = torch.bincount(torch.tensor(toks), minlength=vocab).float() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert (freq - want).abs().max() < 0.025  # ~4 standard errors at n = 6,000


def test_greedy_and_seeded_draws_unchanged_by_the_path():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    keys = [(i, 5) for i in range(4)]
    assert sample(x, keys) == greedy(x) == x.argmax(dim=-1).tolist()
    once = sample(x, keys, method="random", top_k=20, top_p=0.9, seed=4)
    assert once == sample(x.clone(), keys, method="random", top_k=20, top_p=0.9, seed=4)
    assert all(t in x[i].topk(20).indices.tolist() for i, t in enumerate(once))


def _dense_penalties(logits, counts_vm, seen_vm, r, p, f):
    """The replaced dense form of vLLM's penalties, over every [vocab, S] entry."""
    x = logits.t()
    x.copy_(torch.where(seen_vm | (counts_vm > 0), torch.where(x > 0, x / r, x * r), x))
    x.sub_(f * counts_vm.to(x.dtype))
    x.sub_(p * (counts_vm > 0).to(x.dtype))
    return logits


def test_sparse_penalties_equal_the_dense_form():
    from engine.torch_exec.stage.sampling import apply_penalties

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 400, generator=gen) * 4
    counts = (torch.rand(5, 400, generator=gen) < 0.05).int() * torch.randint(1, 4, (5, 400), generator=gen)
    seen = torch.rand(5, 400, generator=gen) < 0.1
    for r, p, f in [(1.3, 0.5, 0.25), (1.0, 0.5, 0.0), (0.7, 0.0, 0.0), (1.0, 0.0, 0.3)]:
        want = _dense_penalties(logits.clone(), counts.t(), seen.t(), r, p, f)
        got = apply_penalties(logits.clone(), counts.t(), seen.t(), repetition=r, presence=p, frequency=f)
        assert torch.equal(got, want), (r, p, f)
        assert not torch.equal(got, logits)


def test_sampler_penalties_equal_the_dense_form_over_steps():
    from engine.torch_exec.stage.sampling import Sampler

    vocab, kw = 300, dict(method="random", temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.4,
                          presence_penalty=0.3, frequency_penalty=0.2)
    s = Sampler(vocab, **kw)
    gen = torch.Generator().manual_seed(2)
    for sid in range(3):
        s.observe_prefill(sid, 0, torch.randint(0, vocab, (40,), generator=gen).tolist())
    for step in range(4):
        logits = torch.randn(3, vocab, generator=gen)
        counts = torch.stack([s.counts[i] for i in range(3)]).t()
        seen = torch.stack([s.seen[i] for i in range(3)]).t()
        pen = _dense_penalties(logits.clone(), counts, seen, 1.4, 0.3, 0.2)
        keys = [(i, 40 + step) for i in range(3)]
        want = sample(pen, keys, method="random", temperature=0.9, top_k=20, top_p=0.9)
        before = logits.clone()
        assert s.sample(logits, keys) == want
        assert torch.equal(logits, before)  # penalised in place, then put back
    assert int(sum(s.counts[i].sum() for i in range(3))) == 12
