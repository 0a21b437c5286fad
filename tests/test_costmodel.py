"""Cost model, model/hardware tables and unit parsing."""
from __future__ import annotations

import dataclasses

import pytest

from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel, split_layers
from engine.base.errors import ConfigError, ImpossibleFitError
from engine.pricing.hardware import HARDWARE, HardwareSpec, get_hardware, register_hardware
from engine.pricing.models import MODELS, ModelSpec, get_model, register_model
from engine.base.units import parse_bandwidth, parse_duration


def cm(model: str = "llama2-70b", hw: str = "a100-80g-roofline", pp: int = 4, **kw) -> CostModel:
    return CostModel(get_model(model), get_hardware(hw), pp=pp, **kw)


# --- models ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, billions, tol",
    [
        ("llama2-70b", 68.98, 0.05),
        ("llama2-13b", 13.02, 0.03),
        ("qwen2.5-32b", 32.76, 0.05),
        ("qwen2.5-7b", 7.62, 0.02),
        ("qwen2.5-14b", 14.77, 0.03),
        ("llama-3.1-70b", 70.55, 0.05),
        ("llama-30b", 32.53, 0.05),
        ("qwen2.5-72b", 72.71, 0.05),
    ],
)
def test_published_param_counts(name, billions, tol):
    assert get_model(name).total_params / 1e9 == pytest.approx(billions, abs=tol)


def test_model_shapes_and_derived_quantities():
    m = get_model("llama2-70b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.intermediate_size, m.vocab_size) == (
        80, 8192, 64, 8, 28672, 32000)
    assert m.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2
    assert m.mlp_params_per_layer == 3 * 8192 * 28672
    assert m.attention_params_per_layer == 8192 * 8192 * 2 + 2 * 8192 * 1024
    q = get_model("qwen2.5-7b")
    assert q.qkv_bias and q.attention_params_per_layer == 2 * 3584 * 3584 + 2 * 3584 * 512 + 3584 + 2 * 512
    assert get_model("llama2-13b").kv_bytes_per_token_per_layer == 2 * 40 * 128 * 2  # MHA


def test_tiny_models_are_small_and_hf_config_roundtrips():
    for name in ("tiny-llama", "tiny-qwen2"):
        m = get_model(name)
        assert 15e6 < m.total_params < 35e6
        again = ModelSpec.from_hf_config(name, m.hf_config())
        assert again == m
    tied = get_model("tiny-qwen2")
    assert tied.tie_word_embeddings
    untied = dataclasses.replace(tied, name="x", tie_word_embeddings=False)
    assert untied.total_params - tied.total_params == tied.lm_head_params


def test_model_registry_errors():
    with pytest.raises(ConfigError, match="unknown model 'llama9'.*llama2-70b"):
        get_model("llama9")
    with pytest.raises(ConfigError, match="duplicate model"):
        register_model(get_model("llama2-13b"))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelSpec("bad", "llama", 2, 64, 6, 4, 16, 128, 100)
    with pytest.raises(ConfigError, match="architecture"):
        ModelSpec("bad", "gpt2", 2, 64, 4, 4, 16, 128, 100)


# --- hardware ----------------------------------------------------------------------------
def test_hardware_table():
    assert {"a100-80g-roofline", "a100-40g-roofline", "a800-80g-roofline", "l20-48g-roofline", "h100-80g-roofline", "rtx4090-roofline"} <= set(HARDWARE)
    a = get_hardware("a100-80g-roofline")
    assert (a.peak_tflops, a.mem_bw_gbs, a.mem_gib) == (312.0, 2039.0, 80.0)
    assert a.p2p_bw_gbs == 20.8 and a.allreduce_bw_gbs == 14.7  # TD-Pipe's PCIe
    assert get_hardware("l20-48g-roofline").peak_tflops == 119.5
    with pytest.raises(ConfigError, match="unknown hardware 'v100'.*a100-80g"):
        get_hardware("v100")
    with pytest.raises(ConfigError, match="duplicate hardware"):
        register_hardware(a)
    with pytest.raises(ConfigError, match="mem_bw_gbs"):
        dataclasses.replace(a, name="broken", mem_bw_gbs=0)


def test_register_calibrated_hardware_is_usable():
    spec = dataclasses.replace(get_hardware("l20-48g-roofline"), name="l20-48g-test-calibrated", peak_tflops=100.0)
    register_hardware(spec)
    try:
        assert get_hardware("l20-48g-test-calibrated").peak_tflops == 100.0
    finally:
        del HARDWARE["l20-48g-test-calibrated"]


# --- units -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        ("100Mbps", 12.5e6),  # bits
        ("100MBps", 100e6),  # bytes
        ("20.8GB/s", 20.8e9),
        ("73.3Gbps", 73.3e9 / 8),
        ("400 Gbit/s", 50e9),
        ("25GiB/s", 25 * 2**30),
        ("1 KiB/s", 1024),
        (2.5e9, 2.5e9),
        ("1e9", 1e9),
    ],
)
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["fast", "100Mb", "-1Gbps", "0", 0, "10 Gbps/s", True, None, "nan"])
def test_parse_bandwidth_errors(bad):
    with pytest.raises(ConfigError) as err:
        parse_bandwidth(bad, key="link.bandwidth")
    message = str(err.value)
    assert "link.bandwidth" in message and repr(bad) in message and "Gbps" in message


@pytest.mark.parametrize(
    "text, expected",
    [("30ms", 0.03), ("10us", 1e-5), ("1.5s", 1.5), ("250ns", 2.5e-7), ("2min", 120.0), (0.25, 0.25), ("0", 0.0)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["-5ms", "soon", "5 parsecs", -1])
def test_parse_duration_errors(bad):
    with pytest.raises(ConfigError, match="ms"):
        parse_duration(bad)


# --- layer split -------------------------------------------------------------------------
def test_split_layers_even_and_remainder_first():
    assert split_layers(80, 4) == (20, 20, 20, 20)
    assert split_layers(10, 4) == (3, 3, 2, 2)
    assert split_layers(7, 7) == (1,) * 7
    assert split_layers(6, 1) == (6,)
    assert split_layers(10, 3, [2, 5, 3]) == (2, 5, 3)


@pytest.mark.parametrize(
    "num_layers, pp, explicit, pattern",
    [
        (10, 3, [2, 5], "parallel.layer_split"),
        (10, 2, [5, 6], "parallel.layer_split.*sums to 11"),
        (10, 2, [10, 0], "parallel.layer_split"),
        (4, 5, None, "parallel.pp=5"),
        (4, 0, None, "parallel.pp"),
    ],
)
def test_split_layers_invalid(num_layers, pp, explicit, pattern):
    with pytest.raises(ConfigError, match=pattern):
        split_layers(num_layers, pp, explicit)


def test_costmodel_validates_parallel_layout():
    with pytest.raises(ConfigError, match="parallel.pp"):
        cm(pp=81)
    with pytest.raises(ConfigError, match="parallel.tp"):
        cm(pp=2, tp=3)
    with pytest.raises(ConfigError, match="parallel.tp"):
        cm(pp=2, tp=0)
    assert cm(pp=3).layers == (27, 27, 26)
    assert cm(pp=2, layer_split=[30, 50]).layers == (30, 50)


# --- batch shape -------------------------------------------------------------------------
def test_batch_shape_from_parts_hand_example():
    # chunk A: prefix 100, 50 tokens, not the end of its prompt; chunk B: a whole 4-token prompt;
    # decodes attending 10 and 20 tokens.
    s = BatchShape.from_parts([(100, 50, False), (0, 4, True)], [10, 20])
    assert s.num_prefill_tokens == 54
    assert s.num_decode_seqs == 2
    assert s.decode_context_sum == 30
    assert s.prefill_attention_pairs == (50 * 100 + 50 * 51 // 2) + (4 * 5 // 2)  # 6275 + 10
    assert s.prefill_context_sum == 150 + 4
    assert s.num_sampled == 3  # chunk B + two decodes
    assert s.num_seqs == 4
    assert s.num_tokens == 56
    assert BatchShape.from_parts([(100, 50, False)]) + BatchShape.from_parts([(0, 4, True)], [10, 20]) == s
    assert BatchShape.decode(3, 7) == BatchShape.from_parts((), [7, 7, 7])


def test_batch_shape_rejects_bad_parts():
    with pytest.raises(ValueError):
        BatchShape.from_parts([(0, 0, True)])
    with pytest.raises(ValueError):
        BatchShape.from_parts((), [0])
    with pytest.raises(ValueError):
        BatchShape(num_decode_seqs=2, decode_context_sum=2, num_sampled=3, num_seqs=2)


# --- compute -----------------------------------------------------------------------------
def test_decode_time_grows_with_batch_and_context():
    m = cm()
    by_batch = [m.stage_compute_s(1, BatchShape.decode(b, 512)) for b in (1, 8, 32, 128, 512)]
    assert all(a < b for a, b in zip(by_batch, by_batch[1:]))
    by_ctx = [m.stage_compute_s(1, BatchShape.decode(32, c)) for c in (16, 256, 2048, 8192)]
    assert all(a < b for a, b in zip(by_ctx, by_ctx[1:]))
    # Small decode batches are weight-bandwidth bound: 1 -> 32 sequences costs far less than 32x.
    assert by_batch[2] < 1.2 * by_batch[0]
    assert m.decode_step_s(64, 1024) > m.decode_step_s(32, 1024)


def test_prefill_chunk_costs_more_after_a_longer_prefix():
    m = cm()
    times = [m.stage_compute_s(0, BatchShape.prefill(512, prefix)) for prefix in (0, 1024, 4096, 16384)]
    assert all(a < b for a, b in zip(times, times[1:]))
    # The attention term grows like a*(2*L*x + x^2): the increase is ~linear in the prefix.
    d1, d2 = times[2] - times[1], times[3] - times[2]
    assert d2 / d1 == pytest.approx((16384 - 4096) / (4096 - 1024), rel=0.05)
    # ...and its size is the causal-attention FLOPs of the extra pairs (x*L) at 50% of peak:
    # 20 layers x 4 x 64 heads x 128 x (512 x 16384) / (312 TFLOPS x 0.5) = 35.2 ms.
    expected = 20 * 4 * 64 * 128 * (512 * 16384) / (312e12 * 0.5)
    assert times[3] - times[0] == pytest.approx(expected, rel=0.05)


def test_last_stage_costs_more_than_middle_stage():
    m = cm()
    for shape in (BatchShape.decode(32, 512), BatchShape.prefill(1024)):
        assert m.stage_compute_s(3, shape) > m.stage_compute_s(1, shape)
        assert m.stage_compute_s(-1, shape) == m.stage_compute_s(3, shape)
    # ...but a chunk that samples nothing skips the lm_head entirely.
    mid_chunk = BatchShape.prefill(1024, 0, samples=False)
    assert m.stage_compute_s(3, mid_chunk) == pytest.approx(m.stage_compute_s(1, mid_chunk))
    # The bottleneck includes GPU sampling on the last stage.
    shape = BatchShape.decode(32, 512)
    assert m.bottleneck_s(shape) == pytest.approx(m.stage_compute_s(3, shape) + m.sample_s(shape))


def test_stage_with_more_layers_is_slower():
    m = cm(pp=3)  # (27, 27, 26)
    shape = BatchShape.decode(16, 256)
    assert m.stage_compute_s(0, shape) > m.stage_compute_s(1, shape) > 0


def test_empty_batch_costs_nothing():
    assert cm().stage_compute_s(0, BatchShape()) == 0.0
    assert cm().sample_s(BatchShape()) == 0.0


def test_tensor_parallel_halves_linear_time_and_adds_allreduce():
    one = cm(pp=4, tp=1)
    two = cm(pp=4, tp=2)
    prefill = BatchShape.prefill(2048, samples=False)  # compute-bound GEMMs dominate
    t1, t2 = one.stage_compute_s(1, prefill), two.stage_compute_s(1, prefill)
    # The same tp=2 model on an (imaginary) infinitely fast interconnect: compute halves.
    fast = dataclasses.replace(get_hardware("a100-80g-roofline"), name="fast", allreduce_bw_gbs=1e12, p2p_latency_s=0.0)
    t2_free = CostModel(get_model("llama2-70b"), fast, pp=4, tp=2).stage_compute_s(1, prefill)
    assert 0.5 * t1 < t2_free < 0.55 * t1
    # On PCIe the all-reduces eat a large part of the gain (why TD-Pipe prefers PP on PCIe).
    assert t2_free < t2 < t1
    allreduce = t2 - t2_free
    # 20 layers x 2 all-reduces x 2048 x 8192 x 2 bytes x ring factor 1 at 14.7 GB/s (+ latency)
    expected = 20 * 2 * (2048 * 8192 * 2 * 1.0 / 14.7e9 + 2 * 10e-6)
    assert allreduce == pytest.approx(expected, rel=0.01)
    decode = BatchShape.decode(32, 512)  # weight-bound: half the weights per GPU
    assert two.stage_compute_s(1, decode) < 0.7 * one.stage_compute_s(1, decode)


def test_coefficients_change_the_prediction():
    shape = BatchShape.prefill(2048)
    slow = cm(coefficients=CostCoefficients(linear_efficiency=0.375))
    assert slow.stage_compute_s(1, shape) > 1.8 * cm().stage_compute_s(1, shape)
    with pytest.raises(ConfigError, match="linear_efficiency"):
        CostCoefficients(linear_efficiency=1.5)
    with pytest.raises(ConfigError, match="stage_overhead_s"):
        CostCoefficients(stage_overhead_s=-1.0)


# --- sampling, CPU work and transfers ----------------------------------------------------
def test_prep_per_context_token_prices_the_shipped_sequence_data():
    """`prep_per_context_token_s` (off by default: prep is unchanged to the bit) adds the unpickling
    of every scheduled sequence's token ids: a decode at context 2,000 pays 10x one at 200."""
    m = cm()
    on = CostModel(m.model, m.hardware, pp=4, tp=1, coefficients=dataclasses.replace(
        m.coefficients, prep_per_context_token_s=1e-7))
    short, long = BatchShape.decode(256, 200), BatchShape.decode(256, 2000)
    assert on.prep_s(short) - m.prep_s(short) == pytest.approx(256 * 200 * 1e-7)
    assert on.prep_s(long) - m.prep_s(long) == pytest.approx(10 * (on.prep_s(short) - m.prep_s(short)))
    assert m.prep_s(long) == m.prep_s(short)


def test_sampling_prep_and_transfers():
    m = cm()
    small, big = BatchShape.decode(8, 100), BatchShape.decode(256, 100)
    assert m.sample_s(big) > m.sample_s(small) > 0
    assert m.cpu_sample_s(big, workers=4) < m.cpu_sample_s(big, workers=1)
    assert m.prep_s(big) > m.prep_s(small) > 0
    assert m.activation_bytes(BatchShape.prefill(100)) == 100 * 8192 * 2
    assert m.token_return_bytes(big) == 256 * 4
    assert m.logits_bytes(small) == 8 * 32000 * 4
    # MoLink: LLaMA-30B sends 13,312 bytes per token.
    assert cm("llama-30b", pp=3).activation_bytes(BatchShape.decode(1, 5)) == 13312
    t = m.transfer_s(1e6, 1e9, 1e-3, structure_aware=True)
    assert t == pytest.approx(2e-3)
    assert m.transfer_s(1e6, 1e9, 1e-3, structure_aware=False) == pytest.approx(2e-3 + m.coefficients.transfer_metadata_s)
    # A 2,048-token Llama2-70B activation over MoLink's 100 Mbps / 30 ms link: ~2.7 s.
    assert m.transfer_s(m.activation_bytes(BatchShape.prefill(2048)), parse_bandwidth("100Mbps"),
                        parse_duration("30ms")) == pytest.approx(0.03 + 2048 * 16384 / 12.5e6)


# --- memory ------------------------------------------------------------------------------
def test_weight_bytes_per_stage():
    m = cm()
    model = get_model("llama2-70b")
    w = m.weight_bytes_per_stage()
    assert sum(w) == model.total_params * 2
    assert w[0] > w[1] == w[2] and w[3] > w[1]
    tied = get_model("tiny-qwen2")
    one = CostModel(tied, get_hardware("a100-80g-roofline"), pp=1).weight_bytes_per_stage()
    two = CostModel(tied, get_hardware("a100-80g-roofline"), pp=2).weight_bytes_per_stage()
    assert one[0] == tied.total_params * 2
    assert sum(two) == (tied.total_params + tied.lm_head_params) * 2  # last stage's own copy


def test_kv_capacity_monotone_in_utilisation_and_pp():
    by_util = [cm(pp=4).kv_capacity_tokens(u) for u in (0.5, 0.7, 0.9, 0.95)]
    assert all(a < b for a, b in zip(by_util, by_util[1:]))
    by_pp = [cm(pp=p).kv_capacity_tokens() for p in (2, 4, 8)]
    assert all(a < b for a, b in zip(by_pp, by_pp[1:]))
    m = cm(pp=4)
    assert m.kv_capacity_tokens(0.9, 16) == 16 * m.kv_capacity_blocks(0.9, 16)
    # Hand check, stage 0 (embedding + 20 layers): (80 GiB * 0.9 - 1.5 GiB - weights) / (4096 B * 20).
    free = 80 * 2**30 * 0.9 - 1.5 * 2**30 - m.weight_bytes_per_stage()[0]
    assert m.kv_capacity_blocks() == int(free // (4096 * 20 * 16))


def test_kv_capacity_with_tp_counts_per_gpu_shards():
    one = cm("llama2-70b", pp=2, tp=1)
    two = cm("llama2-70b", pp=2, tp=2)
    # Half the weights and half the KV heads per GPU: more than twice the tokens.
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()


def test_impossible_fit_names_model_hardware_and_fix():
    m = CostModel(get_model("llama2-70b"), get_hardware("rtx4090-roofline"), pp=1)
    with pytest.raises(ImpossibleFitError) as err:
        m.kv_capacity_tokens()
    message = str(err.value)
    assert "\n" not in message
    for needle in ("llama2-70b", "rtx4090-roofline", "pp=1", "tp=1", "stage 0", "GiB", "parallel.pp", "bigger GPU"):
        assert needle in message
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        cm().kv_capacity_tokens(1.5)


# --- absolute numbers (the documented defaults) ------------------------------------------
class TestAbsoluteNumbers:
    def test_llama2_70b_decode_on_a100_pp4(self):
        t = cm().stage_compute_s(1, BatchShape.decode(32, 512))
        # Floor: 34.2 GB of stage weights at 2,039 GB/s = 16.8 ms; documented ~22.8 ms.
        assert 0.0168 < t < 0.026

    def test_llama2_70b_prefill_chunk_on_a100_stage(self):
        t = cm().stage_compute_s(1, BatchShape.prefill(2048))
        # Floor: 70 TFLOP at 312 TFLOPS = 0.225 s; documented ~0.31 s.
        assert 0.225 < t < 0.35

    def test_sampling_share_on_h100(self):
        m = cm("llama-3.1-70b", "h100-80g-roofline", pp=8)
        shape = BatchShape.decode(512, 800)
        mid, last = m.stage_compute_s(3, shape), m.stage_compute_s(7, shape) + m.sample_s(shape)
        assert 1.15 < last / mid < 1.45  # SiPipe: the last stage does 22-40% more work

    def test_kv_capacity_llama2_70b_4xa100(self):
        tokens = cm().kv_capacity_tokens()
        assert 400_000 < tokens < 600_000  # ~38 GiB free per GPU / 80 KiB per token per stage

    def test_prep_share(self):
        m = cm()
        shape = BatchShape.decode(256, 512)
        share = m.prep_s(shape) / (m.stage_compute_s(1, shape) + m.prep_s(shape))
        assert 0.03 < share < 0.25


@pytest.mark.benchmark
def test_stage_compute_speed(benchmark):
    """The simulator's hot path: pytest-benchmark prints its time per call (about 1 us on the shared
    2-core machine); a figure to read, not a timed assertion. The benchmarked call prices the same
    as a direct one."""
    m = cm(tp=2)
    shape = BatchShape.from_parts([(100, 256, False), (0, 300, True)], [500] * 30)
    got = benchmark(m.stage_compute_s, 1, shape)
    assert got == m.stage_compute_s(1, shape) > 0


def test_one_model_description_parses_config_json_for_both_consumers():
    """`ModelSpec` is the one architecture description (the cost model's shapes, the real engine's
    layers): it reads rope settings from transformers 5 (`rope_parameters`) and 4.x (`rope_scaling`,
    whose type key was once `type`) and writes back what it read."""
    base = get_model("tiny-llama").hf_config()
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    spec = ModelSpec.from_hf_config("x", {**base, "rope_parameters": {"rope_theta": 5e5, **llama3},
                                          "mlp_bias": True})
    assert spec.rope_theta == 5e5 and spec.rope_scaling == llama3 and spec.mlp_bias
    assert ModelSpec.from_hf_config("x", spec.hf_config()) == spec
    legacy = ModelSpec.from_hf_config("x", {**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert hash(spec) == hash(dataclasses.replace(spec, rope_scaling=None))  # a spec stays hashable
