"""Decode attention counts the blocks FlashAttention-2 launches (`decode_split_count`): its split-KV
heuristic, and a fit that picks the count from rows shaped like H100's 405B samples at TP 8."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engine.base.errors import ConfigError
from engine.pricing.kernels import KernelCoefficients, LayerKernels, LayerShape
from engine.pricing.decode_blocks import kv_tile, rows_s, splits
from engine.pricing.profile_table import ProfileRow
from kernel_tables import TRUTH
from testbed.calibrate.kernel_fit import AttentionShape, Device, fit_decode

H100 = dict(peak_flops=989e12, mem_bw_Bps=3350e12, sm_count=132)
TP8 = LayerShape(16384, 128, 8, 128, 53248, tp=8)  # 16 query heads, 1 KV head a GPU
TP2 = LayerShape(16384, 128, 8, 128, 53248, tp=2)
COUNTED = replace(TRUTH, decode_kv_efficiency=((1.0, 0.45),), decode_compute_efficiency=0.1, decode_block_s=35e-9,
                  decode_half_blocks=10.0, decode_waves=2, decode_tail_recovery=0.6, decode_split_s=2e-6,
                  decode_floor_s=8e-6, decode_split_count=1)


def test_the_split_count_is_flashattention2s():
    """H100, 1,344 tokens (11 tiles of 128), one KV head a GPU: the counts behind TP 8's steps."""
    assert kv_tile(128) == 128 and kv_tile(64) == 256 and kv_tile(256) == 64
    assert [splits(b, 132, 11) for b in (33, 34, 36, 37, 49, 67, 73, 100, 105)] == [4, 11, 11, 3, 2, 11, 3, 6, 6]
    assert splits(4, 108, 1) == 1  # one KV tile cannot split
    past = LayerKernels(TP2, COUNTED, **H100)  # 27 x 4 = 108 >= 0.8 x 132 blocks: no split, no regime
    assert past.decode_s(27, 27 * 1344) == pytest.approx(LayerKernels(TP2, replace(COUNTED, decode_split_count=0),
                                                                      **H100).decode_s(27, 27 * 1344), rel=1e-12)


def test_counting_the_pieces_prices_tp8s_steps_down():
    """H100 405B at TP 8: batch 36 -> 37 takes 40 -> 30 us, 72 -> 73 takes 72 -> 52 us (the
    heuristic's count falls from 11 to 3 pieces); per (sequence, KV head) a price only grows."""
    counted = LayerKernels(TP8, COUNTED, **H100)
    per_head = LayerKernels(TP8, replace(COUNTED, decode_split_count=0), **H100)
    for b in (36, 72):
        assert counted.decode_s(b + 1, (b + 1) * 1344) < 0.85 * counted.decode_s(b, b * 1344)
        assert per_head.decode_s(b + 1, (b + 1) * 1344) > per_head.decode_s(b, b * 1344)
    # one tile (32 tokens): no split, so no split regime, where the per-head count pays it
    assert counted.decode_s(4, 4 * 32) < per_head.decode_s(4, 4 * 32)
    assert per_head.decode_s(4, 4 * 32) - counted.decode_s(4, 4 * 32) > COUNTED.decode_split_s * 0.99


def test_a_profile_without_the_count_prices_as_before():
    old = {k: v for k, v in COUNTED.to_mapping().items() if k != "decode_split_count"}
    c = KernelCoefficients.from_mapping(old)
    assert c.decode_split_count == 0
    lk = LayerKernels(TP2, c, **H100)
    units = 20 * TP2.kv_heads_gpu  # below 0.8 x 132: the split regime, blocks = sequences x KV heads
    kv = 20 * 1600 * lk._dec_per_token * (1 + c.decode_half_blocks / units)
    want = c.decode_floor_s + kv + units * c.decode_block_s + c.decode_split_s
    assert lk.decode_s(20, 20 * 1600) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ConfigError, match="decode_split_count"):
        replace(COUNTED, decode_split_count=2)


def test_the_decode_fit_picks_the_count_where_the_rows_follow_it():
    device = Device("h100", **H100)
    shapes = []
    for shape in (TP8, TP2):
        lk = LayerKernels(shape, COUNTED, **H100)
        rows = tuple(ProfileRow("attn_decode", None, "", b, 0, 0, ctx, 0, lk.decode_s(b, b * ctx), tp=shape.tp)
                     for b in range(1, 129, 3) for ctx in (32, 1344, 2688))
        shapes.append(AttentionShape(f"405b/tp{shape.tp}", shape, rows))
    c = fit_decode(shapes, device, KernelCoefficients())
    assert c.decode_split_count == 1
    assert c.decode_block_s == pytest.approx(35e-9, rel=0.15)


@pytest.mark.parametrize("count", [0, 1])
def test_the_fits_row_arrays_price_as_the_scalar_call(count):
    import numpy as np

    lk = LayerKernels(TP2, replace(COUNTED, decode_split_count=count), **H100)
    seqs = np.array([1, 3, 20, 26, 27, 66, 67, 100, 128, 5, 5])
    ctx = np.array([32, 1344, 1600, 128, 2688, 1600, 1664, 2624, 4000, 129, 7])
    want = [lk.decode_s(int(b), int(b * c)) for b, c in zip(seqs, ctx)]
    assert rows_s(lk, seqs, seqs * ctx) == pytest.approx(want, rel=1e-12)


A100 = dict(peak_flops=312e12, mem_bw_Bps=2039e9, sm_count=108)
A100_70B_TP2 = LayerShape(8192, 64, 8, 128, 28672, tp=2)  # 4 KV heads a GPU


def test_a_block_table_wider_than_the_context_sets_the_split_count():
    """The 70B table's profiler sized its block tables to max_model_len = 4,096 tokens (32 tiles):
    at 32 tokens of context (one tile) its small batches still split and pay the regime, and at
    1,024 tokens batch 7 runs in 7 pieces where its context (8 tiles) gives 3 (the table: 24 us,
    against 36 us for batch 8 in 3 pieces); from the context alone neither happens."""
    lk = LayerKernels(A100_70B_TP2, COUNTED, **A100)
    assert splits(7 * 4, 108, 32) == 7 and splits(8 * 4, 108, 32) == 3
    for b in (1, 8, 21):
        assert lk.decode_s(b, b * 32, kv_width=4096) > lk.decode_s(b, b * 32) + 0.9 * COUNTED.decode_split_s
    assert lk.decode_s(7, 7 * 1024) != pytest.approx(lk.decode_s(7, 7 * 1024, kv_width=4096), rel=1e-3)
    assert lk.decode_s(22, 22 * 32, kv_width=4096) == lk.decode_s(22, 22 * 32)  # 88 blocks: no split either way
    import numpy as np
    n = np.array([1, 7, 8, 21, 22]); ctx = n * 1024
    assert rows_s(lk, n, ctx, 4096) == pytest.approx([lk.decode_s(int(a), int(c), 4096) for a, c in zip(n, ctx)], rel=1e-12)


def test_the_table_reader_keeps_the_profilers_block_table_width(tmp_path):
    from testbed.calibrate.gpu_tables import read_attention_csv
    from testbed.calibrate.kernel_fit import attention_shapes

    cols = ["n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "max_model_len", "is_prefill",
            "prefill_chunk_size", "kv_cache_size", "batch_size", "time_stats.attn_prefill.median",
            "time_stats.attn_decode.median"]
    rows = [[8192, 64, 8, 2, 4096, "False", "", 32, b, "", 0.012] for b in (1, 2)]
    path = tmp_path / "t.csv"
    path.write_text(",".join(cols) + "\n" + "\n".join(",".join(map(str, r)) for r in rows) + "\n")
    table = read_attention_csv(path, "a100")
    assert table.meta["kv_width"] == 4096
    assert [s.kv_width for s in attention_shapes([table])] == [4096]
