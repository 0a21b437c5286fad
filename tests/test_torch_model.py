"""The stage model and the sampler in one process (no workers): fast checks of the numerics."""
from __future__ import annotations

import dataclasses
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.core.kv import BlockManager  # noqa: E402
from engine.pricing.models import get_model  # noqa: E402
from engine.torch_exec.weights.checkpoint import read_arch, random_checkpoint, stage_tensor_names  # noqa: E402
from engine.torch_exec.stage.model import StageModel  # noqa: E402
from engine.torch_exec.stage.sampling import sample  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two threads per process on a 2-core machine shared with other processes made a 17-token
    forward take 1.9 s instead of 10 ms (OpenMP spin-waits under oversubscription)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpts(model_cache):
    return {n: random_checkpoint(get_model(n), 0, model_cache) for n in ("tiny-llama", "tiny-qwen2")}


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _stages(path, split, num_blocks=64, block_size=4):
    arch = read_arch(path)
    out, first = [], 0
    for i, n in enumerate(split):
        m = StageModel(arch, first, n, i == 0, i == len(split) - 1, num_blocks, block_size)
        m.load(path)
        out.append(m)
        first += n
    return out


def _generate(stages, prompts, max_new, chunk, kv):
    """A mini driver: chunked prefill of `chunk` tokens, batched decodes, through `stages` in turn."""
    gen = {i: [] for i in range(len(prompts))}
    done = {i: 0 for i in gen}
    torch.manual_seed(123)  # the pools are torch.empty: garbage must never reach the outputs
    while any(len(g) < max_new for g in gen.values()):
        pre, dec = [], []
        for i, p in enumerate(prompts):
            if len(gen[i]) >= max_new:
                continue
            full = p + gen[i]
            if done[i] < len(p):
                n = min(chunk, len(p) - done[i])
                kv.ensure(i, done[i] + n)
                pre.append((i, done[i], n, done[i] + n == len(p), kv.block_table(i), full[done[i]:done[i] + n]))
            else:
                kv.ensure(i, done[i] + 1)
                dec.append((i, done[i], kv.block_table(i), full[done[i]]))
        h = None
        for m in stages:
            h = m.forward(m.prepare(pre, dec), h)
        toks = h.argmax(-1).tolist()
        k = 0
        for i, _s, n, samples, *_ in pre:
            done[i] += n
            if samples:
                gen[i].append(toks[k])
                k += 1
        for i, *_ in dec:
            done[i] += 1
            gen[i].append(toks[k])
            k += 1
    return gen


@pytest.mark.parametrize("name, split", [("tiny-llama", [8]), ("tiny-llama", [3, 5]), ("tiny-qwen2", [2, 2, 2])])
def test_stages_match_hf_greedy(ckpts, name, split):
    path = ckpts[name]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (7, 3, 25, 14)]
    hf = _hf(path)
    ref = {}
    for i, p in enumerate(prompts):
        out = hf.generate(torch.tensor([p]), max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        ref[i] = out[0, len(p):].tolist()
    got = _generate(_stages(path, split), prompts, 9, chunk=5, kv=BlockManager(64, 4))
    assert got == ref
    assert len({t for g_ in got.values() for t in g_}) > 20, "outputs collapsed; the anchor would be weak"


def test_stage_loads_only_its_tensors(ckpts):
    arch = read_arch(ckpts["tiny-llama"])
    names = stage_tensor_names(arch, 2, 3, first=False, last=False)
    assert all(n.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4.")) for n in names)
    m = _stages(ckpts["tiny-llama"], [2, 3, 3])[1]
    assert m.embed is None and m.lm_head is None and len(m.layers) == 3
    q = _stages(ckpts["tiny-qwen2"], [3, 3])[1]  # tied: the last stage's lm_head is the embedding
    assert q.lm_head is not None and q.layers[0].bq is not None


def test_a_position_bug_would_be_caught(ckpts):
    """Mutation check of the anchor's power: decode rows rotated one position too far change the tokens."""
    path = ckpts["tiny-llama"]
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(100, 130))]
    good = _generate(_stages(path, [8]), prompts, 6, chunk=4, kv=BlockManager(64, 4))
    m = _stages(path, [8])[0]
    orig = m.prepare

    def off_by_one(prefills, decodes):
        b = orig(prefills, decodes)
        n = len(decodes)
        if n:
            pos = torch.tensor([d[1] + 1 for d in decodes], dtype=torch.float32)
            freqs = pos[:, None] * m.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            b.cos = torch.cat((b.cos[:-n], emb.cos()))
            b.sin = torch.cat((b.sin[:-n], emb.sin()))
        return b

    m.prepare = off_by_one
    bad = _generate([m], prompts, 6, chunk=4, kv=BlockManager(64, 4))
    assert bad != good


def test_sampling_is_seeded_per_request_and_position():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=g)
    keys = [(1, 10), (2, 10), (3, 5), (4, 7)]
    a = sample(logits, keys, method="random", temperature=1.0, seed=9)
    b = sample(logits, keys, method="random", temperature=1.0, seed=9)
    assert a == b
    # the same row in another batch, at another index, draws the same token
    c = sample(logits[[2, 0]], [keys[2], keys[0]], method="random", temperature=1.0, seed=9)
    assert c == [a[2], a[0]]
    draws = {tuple(sample(logits, keys, method="random", seed=s)) for s in range(10)}
    assert len(draws) > 1
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, keys, method="greedy") == greedy
    assert sample(logits, keys, method="random", top_k=1, seed=3) == greedy
    assert sample(logits, keys, method="random", top_p=1e-6, seed=3) == greedy
    assert sample(logits, keys, method="random", temperature=0.0) == greedy
    top3 = logits.topk(3, dim=-1).indices
    for s in range(20):
        out = sample(logits, keys, method="random", top_k=3, temperature=5.0, seed=s)
        assert all(t in top3[i].tolist() for i, t in enumerate(out))


def test_sharded_checkpoint_loads_like_a_single_file(ckpts, tmp_path):
    """A checkpoint saved in shards (model.safetensors.index.json) gives the same stage tensors."""
    hf = _hf(ckpts["tiny-llama"])
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="20MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a = _stages(ckpts["tiny-llama"], [4, 4])[1]
    b = _stages(str(tmp_path), [4, 4])[1]
    assert torch.equal(a.lm_head, b.lm_head) and torch.equal(a.layers[3].w_down, b.layers[3].w_down)


def test_model_source_resolution(ckpts, tmp_path):
    from engine.base.errors import ConfigError
    from engine.torch_exec.weights.checkpoint import model_source
    from engine.torch_exec.settings import TorchSettings

    path = ckpts["tiny-qwen2"]
    spec = get_model("tiny-llama")
    assert model_source(TorchSettings(model_path=path), spec) == (path, None)
    assert model_source(TorchSettings(), dataclasses.replace(spec, name=path)) == (path, None)
    assert model_source(TorchSettings(), spec) == (None, spec)
    with pytest.raises(ConfigError, match="needs a model"):
        model_source(TorchSettings(), None)
    with pytest.raises(ConfigError, match="no such directory"):
        model_source(TorchSettings(model_path=str(tmp_path / "nope")), None)
    with pytest.raises(ConfigError, match="config.json"):
        model_source(TorchSettings(model_path=str(tmp_path)), None)
    with pytest.raises(ConfigError, match="too large"):
        random_checkpoint(get_model("llama2-70b"), 0, tmp_path)


def test_rope_scaling_llama3_matches_transformers(tmp_path):
    """Llama-3.1-style rope scaling read from config.json gives transformers' inverse frequencies."""
    import json

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.torch_exec.stage.model import inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    spec = get_model("tiny-llama")
    cfg = {**spec.hf_config(), "rope_scaling": scaling, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = read_arch(tmp_path)
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.rope_theta == 500000.0
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**cfg), "cpu")
    assert torch.allclose(inv_freq(arch), ref, rtol=1e-6, atol=0)


def test_decodes_are_grouped_by_length_so_padding_stays_bounded():
    """The torch path pads a group's decodes to its longest: one long decode among short ones
    padded them all (406 ms against 120 ms for the step). Every decode is in exactly one group,
    each group's padded blocks are within the slack of its real ones (a lone decode aside), and
    near-equal decodes stay one group (one set of operations per layer)."""
    import numpy as np

    from engine.torch_exec.stage.model import PADDING_SLACK, decode_groups

    rng = np.random.default_rng(0)
    for blocks in (rng.integers(1, 100, 64), np.array([63] + [10] * 45), rng.integers(1, 4, 7)):
        groups = decode_groups(blocks)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(blocks)))
        for g in groups:
            assert len(g) == 1 or len(g) * blocks[g].max() <= PADDING_SLACK * blocks[g].sum()
        assert len(groups) < len(blocks) // 2  # not one group per decode
    assert [len(g) for g in decode_groups(np.array([63] + [10] * 45))] == [1, 45]
    assert len(decode_groups(np.array([32, 32, 31, 30] * 16))) == 1
    assert decode_groups(np.array([], dtype=int)) == []


def test_cpu_head_is_stored_hidden_by_vocab_with_the_checkpoint_values(ckpts):
    """On CPU the last stage keeps the lm_head [hidden, vocab] in memory (model.head_layout: the row-major
    weight took 4.76 ms at 3 rows against 2.87 ms at 4), the same values as the checkpoint, and its logits
    are the row-major GEMM's to float32 rounding with the same greedy tokens."""
    from safetensors import safe_open
    from engine.torch_exec.kernels.fused import rms_norm
    from engine.torch_exec.stage.model import head_layout
    from engine.torch_exec.weights.checkpoint import LM_HEAD, tensor_files

    last = _stages(ckpts["tiny-llama"], [4, 4])[1]
    w = last.lm_head
    vocab, hidden = w.shape
    assert w.stride() == (1, vocab), "the head's weight is not column-major on CPU"
    files = tensor_files(ckpts["tiny-llama"])
    with safe_open(files[LM_HEAD], framework="pt", device="cpu") as fh:
        ref = fh.get_tensor(LM_HEAD).float()
    assert torch.equal(w, ref)
    torch.manual_seed(0)
    for rows in (1, 3, 4, 64):
        x = torch.randn(rows, hidden)
        got, want = last.logits(x), torch.nn.functional.linear(rms_norm(x, last.norm, last.arch.rms_norm_eps), ref)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    row_major = torch.randn(8, 4)
    assert head_layout(row_major, torch.device("meta")) is row_major  # other devices: as given
    assert head_layout(None, torch.device("cpu")) is None
