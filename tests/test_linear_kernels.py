"""The linear part's kernel terms (issue 36, H100 linear p90): GEMM output-tile waves, the small-M
GEMM kernel's weight streaming apart from the tiled kernel's, and the minimum token count of the
one-block-per-token elementwise kernels (docs/calibration.md#measured-kernels)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.base.errors import ConfigError
from engine.pricing.kernels import GEMM_SMALL_TOKENS, KernelCoefficients, LayerKernels, LayerShape
from kernel_tables import A100, TRUTH, write_tables
from testbed.calibrate.gpu_tables import read_published
from testbed.calibrate.kernel_fit import DEFAULT_FIT_MODELS, Device, fit_elementwise, fit_gemms, layer_shape

H100 = dict(peak_flops=989e12, mem_bw_Bps=3.35e12, sm_count=132)
QWEN_TP1 = LayerShape(hidden=8192, q_heads=64, kv_heads=64, head_dim=128, intermediate=24576)  # QKV: K 8,192, N 24,576
NO_FLOORS = KernelCoefficients(gemm_floor_s=0.0, gemm_memory_floor_s=0.0, gemm_token_quantum=128,
                               gemm_memory_efficiency=1.0)


def _gemm(c: KernelCoefficients, m, shape: LayerShape = QWEN_TP1, hw: dict = H100):
    k, n = shape.gemm_dims()["gemm_qkv"]
    return LayerKernels(shape, c, **hw).gemm_s(np.asarray(m, dtype=float), k, n)


# ---- output-tile waves ---------------------------------------------------------------------------
def test_a_gemm_whose_tiles_spill_into_a_second_wave_pays_for_the_whole_wave():
    # 136 tokens: 2 x 96 tiles of 128 x 256 on 132 SMs = 1.45 waves; whole waves cost 2 / 1.45
    smooth = _gemm(NO_FLOORS, 136)
    whole = _gemm(replace(NO_FLOORS, gemm_tile_n=256, gemm_tail_wave=1.0), 136)
    assert whole / smooth == pytest.approx(2 / (192 / 132), rel=1e-9)
    half = _gemm(replace(NO_FLOORS, gemm_tile_n=256, gemm_tail_wave=0.5), 136)
    assert half / smooth == pytest.approx((192 / 132 + 0.5 * (2 - 192 / 132)) / (192 / 132), rel=1e-9)
    # the measured step: 145 us at 128 tokens, 216 us at 136 (the smooth form priced 154 us)
    fitted = replace(KernelCoefficients(), gemm_compute_efficiency=0.72, gemm_memory_efficiency=0.91,
                     gemm_floor_s=6.6e-6, gemm_memory_floor_s=5.3e-6, gemm_token_quantum=128, gemm_tile_n=256,
                     gemm_tail_wave=1.0)
    assert _gemm(fitted, 136) / _gemm(fitted, 128) > 1.3


def test_no_tile_or_no_sm_count_keeps_the_smooth_form():
    m = np.array([1, 64, 136, 1000, 4096])
    old = _gemm(NO_FLOORS, m)
    k, n = QWEN_TP1.gemm_dims()["gemm_qkv"]
    comp = 2 * np.ceil(m / 128) * 128 * n * k / (989e12 * NO_FLOORS.gemm_compute_efficiency)
    assert old == pytest.approx(np.maximum(comp, (k * n + m * (k + n)) * 2 / 3.35e12))
    tiled = replace(NO_FLOORS, gemm_tile_n=256, gemm_tail_wave=1.0)
    assert _gemm(tiled, m, hw=dict(H100, sm_count=None)) == pytest.approx(old)


# ---- small-M and tiled weight streaming -----------------------------------------------------------
def test_a_gemm_past_the_small_m_kernel_streams_its_weights_at_the_tiled_rate():
    c = replace(NO_FLOORS, gemm_memory_efficiency=0.9, gemm_tile_memory_efficiency=0.6)
    small, tiled = _gemm(c, [GEMM_SMALL_TOKENS, GEMM_SMALL_TOKENS + 1])
    assert tiled / small == pytest.approx(1.5, rel=0.01)  # weight-bound: 0.9 / 0.6 of the rate
    one = _gemm(replace(c, gemm_tile_memory_efficiency=0.0), [GEMM_SMALL_TOKENS, GEMM_SMALL_TOKENS + 1])
    assert one[1] / one[0] == pytest.approx(1.0, rel=0.01)  # 0: one efficiency for every token count


# ---- one-block-per-token elementwise kernels ----------------------------------------------------------
def test_a_per_token_elementwise_kernel_costs_its_minimum_token_count():
    c = replace(KernelCoefficients(), norm_min_tokens=200.0, act_min_tokens=100.0)
    lk = LayerKernels(QWEN_TP1, c, **H100)
    assert float(lk.op_s("norm", 1)) == pytest.approx(float(lk.op_s("norm", 200)))
    assert float(lk.op_s("norm", 400)) > float(lk.op_s("norm", 200))
    assert float(lk.op_s("act", 1)) == pytest.approx(float(lk.op_s("act", 100)))
    old = LayerKernels(QWEN_TP1, KernelCoefficients(), **H100)
    assert float(old.op_s("norm", 1)) < float(old.op_s("norm", 200))
    # a non-gated activation (phi-2's GELU) is a flat elementwise kernel: its own token count
    gelu = LayerKernels(replace(QWEN_TP1, gated_mlp=False, hidden_act="gelu_new"), c, **H100)
    assert float(gelu.op_s("act", 1)) < float(gelu.op_s("act", 100))


# ---- profiles --------------------------------------------------------------------------------------
def test_a_profile_without_the_linear_terms_loads_with_them_off():
    c = KernelCoefficients.from_mapping({"gemm_token_quantum": 64, "gemm_compute_efficiency": 0.7})
    assert (c.gemm_tile_n, c.gemm_tail_wave, c.gemm_tile_memory_efficiency) == (0, 0.0, 0.0)
    assert all(getattr(c, f"{op}_min_tokens") == 0.0 for op in ("norm", "rope", "act", "add", "emb"))
    assert KernelCoefficients.from_mapping({"gemm_tile_n": 256.0}).gemm_tile_n == 256


@pytest.mark.parametrize("bad", [{"gemm_tail_wave": 1.5}, {"gemm_tail_wave": -0.1}, {"gemm_tile_n": 1.5},
                                 {"gemm_tile_memory_efficiency": 1.2}, {"norm_min_tokens": -1.0}])
def test_invalid_linear_terms_are_refused(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        KernelCoefficients(**bad)


# ---- the fit ---------------------------------------------------------------------------------------
def test_the_fit_recovers_tile_waves_streaming_rates_and_minimum_token_counts(tmp_path):
    truth = replace(TRUTH, gemm_tile_n=128, gemm_tail_wave=0.5, gemm_tile_memory_efficiency=0.6,
                    norm_min_tokens=200.0, act_min_tokens=100.0)
    t = read_published(write_tables(tmp_path, truth).parent, "a100")
    tables = [t.compute[m] for m in DEFAULT_FIT_MODELS]
    device = Device("a100", **A100)
    c = fit_elementwise(tables, device, fit_gemms(tables, device, KernelCoefficients()))
    assert (c.gemm_token_quantum, c.gemm_tile_n) == (64, 128)
    for name in ("gemm_tail_wave", "gemm_tile_memory_efficiency", "gemm_memory_efficiency", "gemm_compute_efficiency",
                 "norm_min_tokens", "act_min_tokens", "norm_efficiency"):
        assert getattr(c, name) == pytest.approx(getattr(truth, name), rel=0.02), name
    # the held-out model is priced as the truth prices it
    held = t.compute["Held-Out-13b"]
    for r in held.rows[:400]:
        lk = LayerKernels(layer_shape(held.meta, r.tp), c, **A100)
        assert float(lk.op_s(r.op, r.tokens)) == pytest.approx(r.time_s, rel=0.02), (r.op, r.tokens, r.tp)


def test_a_profile_with_no_gemm_past_the_small_m_kernel_keeps_one_streaming_rate(tmp_path):
    t = read_published(write_tables(tmp_path).parent, "a100")
    table = t.compute["Llama-2-7b-hf"]
    small = replace(table, rows=[r for r in table.rows if r.tokens <= GEMM_SMALL_TOKENS])
    c = fit_gemms([small], Device("a100", **A100), KernelCoefficients())
    assert c.gemm_tile_memory_efficiency == 0.0
    assert c.gemm_memory_efficiency == pytest.approx(TRUTH.gemm_memory_efficiency, rel=0.02)
