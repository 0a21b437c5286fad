"""bf16 numerics of the stage model against Hugging Face, with a tolerance derived from bf16 itself.

A fixed tolerance would be arbitrary; instead the first-step logits of our bf16 forward must be as
close to the float32 reference as Hugging Face's own bf16 forward is (within 1.5x of HF's bf16
error). Measured on CPU for tiny-llama, 5 prompts of 5-100 tokens: HF bf16 is 0.49 off float32
(logit std 1.6); our torch path equals HF bf16 exactly, the Triton path is 0.31 off HF bf16.

Why not "the same first 32 greedy tokens for 45 of 50 prompts": on a random-weight model two
correct bf16 implementations disagree almost always. Measured on CPU with tiny-llama, 50 prompts
of 4-120 tokens, 32 greedy tokens: HF bf16 (SDPA) vs HF float32 agree on 1 of 50 prompts, HF bf16
with SDPA vs HF bf16 with eager attention on 0 of 50. Random logits are nearly flat, so one
rounding difference flips an argmax and the sequences part. That criterion needs trained weights;
token-exact agreement is checked in float32 (test_torch_engine.py, test_cuda_graphs.py).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.core.kv import BlockManager  # noqa: E402
from engine.pricing.models import get_model  # noqa: E402
from engine.torch_exec.weights.checkpoint import random_checkpoint, read_arch  # noqa: E402
from engine.torch_exec.stage.model import StageModel  # noqa: E402
from engine.torch_exec.kernels.paged_attention import HAVE_TRITON  # noqa: E402

PROMPT_LENS = (5, 17, 33, 64, 100)
SLACK = 1.5  # our bf16 error may be at most this times HF's bf16 error against float32


@pytest.fixture(scope="module")
def tiny(model_cache):
    return random_checkpoint(get_model("tiny-llama"), 0, model_cache)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_last_logits(path: str, prompts, dtype, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([p], device=device)).logits[0, -1].float().cpu() for p in prompts])


def _our_last_logits(path: str, prompts, attention: str, device: str) -> torch.Tensor:
    arch = read_arch(path)
    m = StageModel(arch, 0, arch.num_layers, True, True, 512, 16, dtype="bfloat16", device=device,
                   attention=attention)
    m.load(path)
    kv = BlockManager(512, 16)
    pre = []
    for i, p in enumerate(prompts):
        kv.ensure(i, len(p))
        pre.append((i, 0, len(p), True, kv.block_table(i), p))
    return m.forward(m.prepare(pre, []), None).float().cpu()


def _check(path: str, attention: str, device: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(read_arch(path).vocab_size)
    ref32 = _hf_last_logits(path, prompts, torch.float32, device)
    hf16 = _hf_last_logits(path, prompts, torch.bfloat16, device)
    ours = _our_last_logits(path, prompts, attention, device)
    hf_err = (hf16 - ref32).abs().max().item()
    our_err = (ours - ref32).abs().max().item()
    assert hf_err > 0, "the bf16 reference should differ from float32 (else the bound is vacuous)"
    assert our_err <= SLACK * hf_err, f"bf16 logits {our_err:.3f} off float32; HF's bf16 is {hf_err:.3f} off"
    # where float32's top-1 leads by more than both errors, bf16 must pick the same token
    top2 = ref32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * max(hf_err, our_err)
    assert torch.equal(ours.argmax(-1)[clear], ref32.argmax(-1)[clear])


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
def test_bf16_logits_torch_path_on_cpu(tiny):
    _check(tiny, "torch", "cpu")


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is part of the dev extra")
def test_bf16_logits_triton_path_on_cpu(tiny):
    """Triton's interpreter on CPU (tests/conftest.py selects it where there is no GPU)."""
    _check(tiny, "triton", "cpu")


def test_the_bound_catches_a_wrong_model(tiny, monkeypatch):
    """A bf16 forward with RMSNorm's epsilon 100x too large is beyond the bound: it can fail."""
    arch = read_arch(tiny)
    prompts = _prompts(arch.vocab_size)
    ref32 = _hf_last_logits(tiny, prompts, torch.float32, "cpu")
    hf_err = (_hf_last_logits(tiny, prompts, torch.bfloat16, "cpu") - ref32).abs().max().item()
    import engine.torch_exec.stage.model as model_mod

    real = model_mod.rms_norm
    monkeypatch.setattr(model_mod, "rms_norm", lambda x, w, eps: real(x, w, eps * 100 + 1e-2))
    wrong = _our_last_logits(tiny, prompts, "torch", "cpu")
    assert (wrong - ref32).abs().max().item() > SLACK * hf_err


@pytest.mark.gpu
def test_bf16_logits_on_cuda(tiny):
    _check(tiny, "auto", "cuda")
