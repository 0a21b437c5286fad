"""The cost model's GPU terms: neutral by default, each one moves the shapes it should."""
from __future__ import annotations

import pytest

from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel
from engine.base.errors import ConfigError
from engine.pricing.hardware import get_hardware
from engine.pricing.models import get_model

SHAPES = [
    BatchShape.decode(1, 16), BatchShape.decode(64, 4096), BatchShape.decode(256, 700),
    BatchShape.prefill(16), BatchShape.prefill(2048, 1024), BatchShape.prefill(512, samples=False),
    BatchShape.from_parts([(0, 256, True)], [512] * 32), BatchShape.from_parts([(300, 40, False), (0, 8, True)]),
]


def _cost(pp: int = 2, **kw) -> CostModel:
    return CostModel(get_model("qwen2.5-7b"), get_hardware("h100-80g-roofline"), pp, coefficients=CostCoefficients(**kw))


def _times(cost: CostModel) -> list[float]:
    return [cost.stage_compute_s(s, sh) for sh in SHAPES for s in range(cost.pp)]


def test_neutral_values_give_the_same_floats():
    base = _times(_cost())
    neutral = dict(kv_read_efficiency=0.0, linear_half_tokens=0.0, attention_half_context=0.0,
                   decode_overhead_ratio=1.0)
    assert _times(_cost(**neutral)) == base
    # kv_read_efficiency=0 means "memory_efficiency": the same as naming it
    assert _times(_cost(kv_read_efficiency=0.8)) == base
    assert _times(_cost(memory_efficiency=0.5, kv_read_efficiency=0.5)) == _times(_cost(memory_efficiency=0.5))


@pytest.mark.parametrize("terms", [
    {}, {"kv_read_efficiency": 0.4}, {"linear_half_tokens": 100.0}, {"attention_half_context": 256.0},
    {"decode_overhead_ratio": 0.25},
    {"kv_read_efficiency": 0.4, "linear_half_tokens": 100.0, "attention_half_context": 256.0,
     "decode_overhead_ratio": 0.25},
])
def test_all_stages_at_once_matches_one_by_one(terms):
    cost = _cost(pp=3, **terms)
    for sh in SHAPES:
        assert cost.stage_compute_all_s(sh) == tuple(cost.stage_compute_s(s, sh) for s in range(3))


def test_kv_read_efficiency_slows_long_context_decodes_only():
    base, slow = _cost(), _cost(kv_read_efficiency=0.4)
    long_ctx = BatchShape.decode(64, 4096)
    assert slow.stage_compute_s(0, long_ctx) > 1.3 * base.stage_compute_s(0, long_ctx)  # KV reads dominate
    tiny = BatchShape.decode(1, 16)
    assert slow.stage_compute_s(0, tiny) == pytest.approx(base.stage_compute_s(0, tiny), rel=1e-3)


def test_gemm_efficiency_by_m():
    # GEMM time ~ (M + half) x the per-token time: a compute-bound prefill does `half` tokens more work
    half = 128.0
    base, curved = _cost(pp=1), _cost(pp=1, linear_half_tokens=half)
    for m in (2048, 4096):
        sh = BatchShape.prefill(m, samples=False)
        extra = curved.stage_compute_s(0, sh) - base.stage_compute_s(0, sh)
        assert extra == pytest.approx(curved.layers[0] * half * curved._lin_c, rel=1e-9)
    # a mid-M decode that streams weights at the nominal efficiency becomes compute-bound
    d = BatchShape.decode(200, 64)
    assert curved.stage_compute_s(0, d) > base.stage_compute_s(0, d)
    one = BatchShape.decode(1, 64)
    assert curved.stage_compute_s(0, one) == base.stage_compute_s(0, one)  # still weight-bound


def test_attention_efficiency_by_context():
    # decode attention x (1 + half / context): the extra share falls as 1 / context
    half = 512.0
    base, curved = _cost(pp=1), _cost(pp=1, attention_half_context=half)
    n, layers = 64, base.layers[0]
    shares = []
    for ctx in (64, 4096):
        sh = BatchShape.decode(n, ctx)
        attention = layers * (n * ctx * base._kv_r + n * base._qo)  # memory-bound on an H100
        assert n * ctx * base._attn_c < n * ctx * base._kv_r
        extra = curved.stage_compute_s(0, sh) - base.stage_compute_s(0, sh)
        assert extra == pytest.approx(attention * half / ctx, rel=1e-9)
        shares.append(extra / attention)
    assert shares[0] == pytest.approx(64 * shares[1])
    # prefill chunks by their mean context (prefix + chunk)
    sh = BatchShape.from_parts([(1024, 1024, True), (0, 1024, True)])
    assert curved.stage_compute_s(0, sh) > base.stage_compute_s(0, sh)


def test_decode_overhead_ratio_applies_to_decode_only_steps():
    c = CostCoefficients()
    base, graphs = _cost(pp=2), _cost(pp=2, decode_overhead_ratio=0.25)
    for s, n in enumerate(base.layers):
        eager = c.stage_overhead_s + c.per_layer_overhead_s * n
        d = BatchShape.decode(8, 512)
        assert base.stage_compute_s(s, d) - graphs.stage_compute_s(s, d) == pytest.approx(0.75 * eager, rel=1e-9)
        for sh in (BatchShape.prefill(64), BatchShape.from_parts([(0, 64, True)], [512] * 8)):
            assert graphs.stage_compute_s(s, sh) == base.stage_compute_s(s, sh)  # eager steps unchanged


@pytest.mark.parametrize("key, value", [("kv_read_efficiency", 1.5), ("kv_read_efficiency", -0.1),
                                        ("linear_half_tokens", -1.0), ("attention_half_context", float("inf")),
                                        ("decode_overhead_ratio", -0.5)])
def test_bad_gpu_terms_rejected(key, value):
    with pytest.raises(ConfigError, match=f"cost.{key}="):
        CostCoefficients(**{key: value})
