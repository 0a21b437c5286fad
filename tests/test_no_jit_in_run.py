"""No Triton compile inside a run (issue 47): every variant of the engine's kernels a run can need
is compiled when the stage starts (its CUDA and piecewise graphs are captured and its attention
warmed), so a run adds none. The 1a5c8d9 H100 runs stalled 0.48-0.98 s on 8 micro-batches whose
specialisation key (a pointer's 16-byte alignment: the index arrays are views into one packed
buffer at data-dependent offsets) was new; the kernels no longer specialise on it
(engine/torch_exec/kernels/paged_attention.py). Marked `gpu`: collected everywhere, run on CUDA."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def _stage(model: str = "tiny-llama", num_blocks: int = 4096, block_size: int = 16):
    """The whole model as one stage, set up as a spawned stage sets itself up (graphs captured)."""
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_tensors, spec_arch, stage_tensor_names
    from engine.torch_exec.stage.model import StageModel

    arch = spec_arch(get_model(model))
    L = arch.num_layers
    m = StageModel(arch, 0, L, True, True, num_blocks, block_size, dtype="bfloat16", device="cuda")
    m.set_weights(random_tensors(arch, stage_tensor_names(arch, 0, L, True, True), 0, m.dtype, m.device))
    m.configure(None, cuda_graphs=True)
    return m


def _mixed_steps(n: int, num_blocks: int, block_size: int, seed: int = 0):
    """Micro-batches as a serving run forms them: decodes of varied contexts and counts, prefill
    chunks of varied sizes beside them, and so index arrays at every offset of the packed buffer."""
    rng = random.Random(seed)
    cursor = 0

    def table(ctx: int) -> list[int]:
        nonlocal cursor
        k = -(-(ctx + 1) // block_size) + 1
        out = [(cursor + i) % num_blocks for i in range(k)]
        cursor += k
        return out

    for step in range(n):
        decodes = [(100 + i, c - 1, table(c), 7) for i, c in
                   enumerate(rng.randint(1, 1500) for _ in range(rng.choice((1, 2, 3, 7, 16, 17, 33, 64))))]
        prefills = []
        if step % 3:
            size, start = rng.randint(1, 600), rng.choice((0, 0, 37, 512))
            prefills = [(9000 + step, start, size, 1, table(start + size), [1] * size)]
        yield prefills, decodes


def test_a_run_compiles_no_triton_variant():
    from engine.torch_exec.kernels.variants import compiled_variants

    m = _stage()
    torch.cuda.synchronize()
    before = compiled_variants()
    assert before and sum(before.values()) > 0  # the start-up compiled the kernels it uses
    for prefills, decodes in _mixed_steps(120, 4096, 16):
        m.forward(m.prepare(prefills, decodes), None)
    torch.cuda.synchronize()
    after = compiled_variants()
    print(f"compiled Triton variants: at start-up {before}, after 120 mixed steps {after}")
    assert after == before, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
