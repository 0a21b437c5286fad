"""Measure this project's CPU sampler (engine/torch_exec/stage/sampling.py `Sampler`, what each SiPipe
sampler process runs per job) on this machine, and fit the cost model's CPU-sampling terms.

One thread (a sampler process owns one core), fp32 logits as the stage sends them, rows x vocab
over the settings the studies use: greedy; temperature 0.8 with top-p 0.95 and top-k 50; the same
with SiPipe's penalties on (repetition 1.1, presence 0.1, frequency 0.1), each row's sequence having seen a
512-token prompt (the penalties touch only the entries a sequence has seen). Each point is the fastest
of `--repeats` calls in the thread's own CPU time (`time.thread_time`: on the shared 2-core machine
at load ~20 the wall time of a 30 ms sort was inflated 5-10x by waiting for a core; a sampler
process owns its core). Fit per setting:
time = fixed + per_row x rows + per_row_vocab x rows x vocab, non-negative least squares on relative
error. The per-row term (a row's seeded draw and its penalty-hit gather, whatever the vocabulary)
took the penalties setting's median error from 20% to 3.5% (base46b, same 18 points).

    python scripts/measure_cpu_sampler.py --out engine/pricing/measured/cpu_sampler.json
    python scripts/measure_cpu_sampler.py --refit engine/pricing/measured/cpu_sampler.json  # fit the stored points again
    python scripts/measure_cpu_sampler.py --paths --out engine/pricing/measured/cpu_sampler_paths.json

The JSON keeps the points, the fits and the provenance (host CPU, torch, threads, load, date,
commit). The IPC of a job (ZeroMQ frames of the rows' logits) is not in it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)  # SiPipe's, as measured
SETTINGS = {
    "greedy": dict(method="greedy"),
    "top_p_top_k": dict(method="random", temperature=0.8, top_p=0.95, top_k=50),
    "top_p_top_k_penalties": dict(method="random", temperature=0.8, top_p=0.95, top_k=50, **PENALTIES),
}
# `--paths`: every path the sampler can take (engine/pricing/cpu_sampling_paths.py names them): greedy
# or random; random with top-k (then top-p on the k), with top-p alone (a full-vocabulary sort) or
# with neither (a softmax over the vocabulary); each with and without the penalties.
PATHS = {
    "greedy": dict(method="greedy"),
    "greedy_penalties": dict(method="greedy", **PENALTIES),
    "random": dict(method="random", temperature=0.8),
    "random_penalties": dict(method="random", temperature=0.8, **PENALTIES),
    "top_k": dict(method="random", temperature=0.8, top_p=0.95, top_k=50),
    "top_k_penalties": dict(method="random", temperature=0.8, top_p=0.95, top_k=50, **PENALTIES),
    "top_p": dict(method="random", temperature=0.8, top_p=0.95),
    "top_p_penalties": dict(method="random", temperature=0.8, top_p=0.95, **PENALTIES),
}
ROWS = (1, 8, 32)
VOCABS = (32000, 152064)
PROMPT = 512  # prompt tokens each row's sequence has seen (the penalties touch those entries)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(repeats: int, settings: dict[str, dict]) -> list[dict]:
    import torch

    from engine.torch_exec.stage.sampling import Sampler

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    points = []
    for name, kw in settings.items():
        for vocab in VOCABS:
            for rows in ROWS:
                sampler = Sampler(vocab, **kw)
                logits = torch.randn(rows, vocab, generator=gen)
                for i in range(rows):
                    sampler.observe_prefill(i, 0, torch.randint(0, vocab, (PROMPT,), generator=gen).tolist())
                best = float("inf")
                for step in range(repeats):
                    keys = [(i, step) for i in range(rows)]
                    t0 = time.thread_time()
                    sampler.sample(logits, keys)
                    best = min(best, time.thread_time() - t0)
                points.append({"setting": name, "vocab": vocab, "rows": rows, "time_s": best})
    return points


def fit(points: list[dict]) -> dict:
    import numpy as np
    from scipy.optimize import lsq_linear

    out = {}
    for name in dict.fromkeys(p["setting"] for p in points):
        sel = [p for p in points if p["setting"] == name]
        rows = np.array([p["rows"] for p in sel], dtype=float)
        x = np.array([p["rows"] * p["vocab"] for p in sel], dtype=float)
        y = np.array([p["time_s"] for p in sel])
        a = np.stack([np.ones_like(x), rows, x], axis=1)
        scale = a.max(axis=0)  # columns of 1, ~32 and ~5e6: scaled so the solver treats them alike
        sol = lsq_linear(a / scale / y[:, None], np.ones_like(y), bounds=(0, np.inf)).x / scale
        fixed, per_row, per = (float(v) for v in sol)
        err = np.abs(a @ sol / y - 1)
        out[name] = {"cpu_sample_fixed_s": fixed, "cpu_sample_per_row_s": per_row, "cpu_sample_per_token_vocab_s": per,
                     "median_error": float(np.median(err)), "max_error": float(err.max())}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="fit the points of this JSON again and rewrite its fit")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--paths", action="store_true", help="every sampler path (PATHS), not the studies' three settings")
    args = ap.parse_args()
    if args.refit is not None:
        record = json.loads(args.refit.read_text())
        record["fit"] = fit(record["points"])
        args.refit.write_text(json.dumps(record, indent=1) + "\n")
        _print(record["fit"])
        return 0
    if args.out is None:
        ap.error("--out or --refit is required")
    settings = PATHS if args.paths else SETTINGS
    load_before = os.getloadavg()
    points = measure(args.repeats, settings)
    import torch

    record = {
        "what": "engine/torch_exec/stage/sampling.py Sampler.sample on CPU, one thread, fp32 logits",
        "command": f"python scripts/measure_cpu_sampler.py --out {args.out} --repeats {args.repeats}"
                   + (" --paths" if args.paths else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "commit": _commit(), "cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "threads": 1, "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "statistic": f"fastest of {args.repeats} calls, thread CPU time (time.thread_time)",
        "settings": settings, "prompt_tokens_per_row": PROMPT, "points": points, "fit": fit(points),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    _print(record["fit"])
    return 0


def _print(fits: dict) -> None:
    for name, f in fits.items():
        print(f"{name}: fixed {f['cpu_sample_fixed_s'] * 1e6:.0f} us, {f['cpu_sample_per_row_s'] * 1e6:.1f} us per row, "
              f"{f['cpu_sample_per_token_vocab_s'] * 1e9:.3f} ns per row x vocab entry "
              f"(median error {f['median_error']:.1%}, max {f['max_error']:.1%})")


if __name__ == "__main__":
    raise SystemExit(main())
