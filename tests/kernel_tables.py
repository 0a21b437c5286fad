"""Small published-format GPU tables written by tests (the Vidur layout testbed/calibrate/gpu_tables.py reads),
generated from known kernel coefficients so a fit can be checked against the truth."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from engine.pricing.kernels import KernelCoefficients, LayerKernels, LayerShape

A100 = dict(peak_flops=312e12, mem_bw_Bps=2039e9, sm_count=108)
TRUTH = KernelCoefficients(gemm_compute_efficiency=0.68, gemm_memory_efficiency=0.81, gemm_floor_s=4e-6,
                           gemm_token_quantum=64, norm_efficiency=0.3, rope_efficiency=0.45, act_efficiency=0.55,
                           add_efficiency=0.85, emb_efficiency=0.4, elementwise_floor_s=2.5e-6, decode_floor_s=11e-6,
                           decode_kv_efficiency=((8.0, 0.72),), decode_waves=2, prefill_floor_s=9e-6,
                           prefill_efficiency=0.3, prefill_half_keys=700.0)
MODELS = {  # name: (hidden, heads, kv heads, intermediate, vocab)
    "Llama-2-7b-hf": (4096, 32, 32, 11008, 32000),
    "Llama-2-70b-hf": (8192, 64, 8, 28672, 32000),
    "Held-Out-13b": (5120, 40, 40, 13824, 32000),
}
MLP_COLUMNS = {"gemm_qkv": "attn_pre_proj", "gemm_o": "attn_post_proj", "gemm_up": "mlp_up_proj",
               "gemm_down": "mlp_down_proj", "rope": "attn_rope", "act": "mlp_act", "add": "add", "emb": "emb"}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 100, 128, 129, 200, 256, 300, 512, 700, 1024, 1500, 2048, 3000, 4096]


def _stats(op: str, ms: float) -> dict[str, float]:
    return {f"time_stats.{op}.{s}": ms for s in ("min", "max", "mean", "median")} | {f"time_stats.{op}.std": 0.0}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def mlp_records(shape: tuple[int, int, int, int, int], gated: bool, truth: KernelCoefficients,
                ms=lambda t: t * 1e3) -> list[dict]:
    """`mlp.csv` records of one model (hidden, heads, KV heads, intermediate, vocab) at TP 1 and 2."""
    h, q, kv, inter, vocab = shape
    rows = []
    for tp in (1, 2):
        lk = LayerKernels(LayerShape(h, q, kv, h // q, inter, vocab, gated, tp), truth, **A100)
        for m in TOKENS:
            rec: dict = {}
            for op, col in MLP_COLUMNS.items():
                rec |= _stats(col, ms(float(lk.op_s(op, m))))
            norm = ms(float(lk.op_s("norm", m)))
            rec |= _stats("input_layernorm", norm) | _stats("post_attention_layernorm", norm)
            rec |= {"n_head": q, "n_kv_head": kv, "n_embd": h, "n_expanded_embd": inter, "vocab_size": vocab,
                    "use_gated_mlp": gated, "num_tokens": m, "num_tensor_parallel_workers": tp}
            rows.append(rec)
    return rows


def write_tables(root: Path, truth: KernelCoefficients = TRUTH, noise: float = 0.0, seed: int = 0) -> Path:
    """gpu-op-profiles/ under `root`: A100 compute for MODELS (TP 1 and 2), one attention table of
    the 70B shape at TP 2, send/recv and all-reduce of one setup, one host table."""
    rng = np.random.default_rng(seed)

    def ms(t: float) -> float:
        return float(t * 1e3 * (1.0 + noise * rng.uniform(-1, 1)))

    top = root / "gpu-op-profiles"
    for name, shape in MODELS.items():
        _write(top / "compute" / "a100" / "org" / name / "mlp.csv", mlp_records(shape, True, truth, ms))
    lk = LayerKernels(LayerShape(8192, 64, 8, 128, 28672, 32000, True, 2), truth, **A100)
    att = []
    base = {"n_embd": 8192, "n_q_head": 64, "n_kv_head": 8, "block_size": 16, "num_tensor_parallel_workers": 2,
            "max_model_len": 4096, "attention_backend": "AttentionBackend.FLASH_ATTENTION", "profile_method": "x"}
    for b in (1, 3, 8, 20, 27, 40, 54, 55, 80, 108, 109, 128):
        for ctx in (32, 256, 1024, 2048, 4064):
            att.append(_stats("attn_decode", ms(lk.decode_s(b, b * ctx))) | _stats("attn_prefill", float("nan"))
                       | base | {"batch_size": b, "prefill_chunk_size": 0, "kv_cache_size": ctx, "is_prefill": False})
    for x in (64, 128, 256, 512, 1024, 2048, 4096):
        for prefix in (0, 256, 1024, 2048):
            if x + prefix <= 4096:
                t = lk.prefill_s(x, 1, x * prefix + x * (x + 1) / 2, prefix + x)
                att.append(_stats("attn_decode", float("nan")) | _stats("attn_prefill", ms(t)) | base
                           | {"batch_size": 1, "prefill_chunk_size": x, "kv_cache_size": prefix, "is_prefill": True})
    _write(top / "attention" / "a100-test-shape.csv", att)
    for coll, lat, bw in (("send_recv", 12e-6, 200e9), ("all_reduce", 5e-6, 150e9)):
        rows = []
        for i, size in enumerate(2 ** k for k in range(11, 28, 2)):
            for nw in ((2,) if coll == "send_recv" else (2, 4, 8)):
                mult, wire = (1.0, size) if coll == "send_recv" else (2.0 * (nw - 1), 2.0 * (nw - 1) / nw * size)
                for rank in range(2):
                    rows.append({"": i} | _stats(coll, ms(mult * lat + wire / bw)) | {
                        "rank": rank, "num_workers": nw, "size": size, "collective": coll, "devices_per_node": nw,
                        "max_devices_per_node": 8})
        _write(top / "network" / "a100_testbox" / f"{coll}.csv", rows)
    host = []
    for b in (1, 8, 32, 128):
        host.append({"": b, "prepare_inputs_e2e_median": 0.3 + 0.002 * b, "sampler_e2e_median": 0.6 + 0.004 * b,
                     "schedule_median": 0.05 + 0.003 * b, "model_name": "org/Llama-2-7b-hf", "batch_size": b,
                     "tensor_parallel_degree": 1})
    _write(top / "cpu_overheads" / "a100-test.csv", host)
    return top
