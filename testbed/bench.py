"""`testbed bench sim`: speed and memory of the simulator, as figures (never as test assertions).

Each measured run is a fresh subprocess so that its peak RSS (ru_maxrss) is its own. The
reference setting is TD-Pipe's: 5,000 ShareGPT requests offline (prompt + output <= 4,096 tokens,
Llama-2's context), Llama2-70B on 4 x A100-80GB.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys

REFERENCE = ["workload=sharegpt", "workload.arrival=offline", "workload.num_requests=5000", "workload.max_total_len=4096",
             "hardware=a100-80g", "model=llama2-70b", "parallel.pp=4"]


def measure_once(overrides: list[str]) -> dict:
    """Run in this process; return timings, peak memory and the headline metrics."""
    from testbed.config import compose, to_container
    from testbed.overrides import merge
    from testbed.runner import prepare_experiment

    cfg = to_container(compose(merge(overrides, ["output.mlflow=false", "output.progress=false"])))
    result = prepare_experiment(cfg).run()
    s = result.summary
    return {"overrides": overrides, "simulate_s": result.info["simulate_s"], "build_s": result.info["build_s"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "num_microbatches": s["num_microbatches"],
            "microbatches_per_wall_s": result.info["microbatches_per_wall_s"],
            "throughput_tok_s": s["throughput_tok_s"], "bubble_ratio": s["bubble_ratio"],
            "ttft_mean_s": s["ttft_mean_s"], "tpot_mean_s": s["tpot_mean_s"], "num_preemptions": s["num_preemptions"]}


def measure(overrides: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "testbed.bench", "--child", json.dumps(overrides)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark run {overrides} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_sim_bench(policies: list[str], extra: list[str]) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    from testbed.overrides import merge

    rows = [measure(merge([f"policy={p}", *REFERENCE], extra)) for p in policies]
    t = Table(title="simulator benchmark: " + " ".join(REFERENCE + extra))
    for col in ("policy", "simulate s", "peak RSS MB", "micro-batches", "mb / wall s", "throughput tok/s",
                "bubble", "TTFT mean s", "TPOT mean s"):
        t.add_column(col, justify="right")
    for p, r in zip(policies, rows):
        t.add_row(p, f"{r['simulate_s']:.2f}", f"{r['peak_rss_mb']:.0f}", str(r["num_microbatches"]),
                  f"{r['microbatches_per_wall_s']:.0f}", f"{r['throughput_tok_s']:.0f}", f"{r['bubble_ratio']:.3f}",
                  f"{r['ttft_mean_s']:.1f}", f"{r['tpot_mean_s']:.4f}")
    Console(width=max(160, Console().width)).print(t)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure_once(json.loads(sys.argv[2]))))
