"""CPU sampling (SiPipe's sampler processes) priced by the sampling parameters a run uses (issue 46 item 2).

The cost model's CPU-sampling terms (`cpu_sample_*`, engine/pricing/cost_coefficients.py) were measured
at one setting: SiPipe's (temperature 0.8, top-p 0.95, top-k 50, the three penalties on; the
sipipe-ablation study samples with exactly these). This project's sampler (engine/torch_exec/stage/
sampling.py) takes a different path for other settings, and the paths differ by 400x per row and
vocabulary entry. All eight measured in one run (engine/pricing/measured/cpu_sampler_paths.json,
`python scripts/measure_cpu_sampler.py --paths`, this machine's AMD EPYC, one thread, load 0.3,
2026-11-29), per row x vocabulary entry: greedy 0.044 ns (numpy's argmax), top-k 0.77 ns (`topk`,
then top-p on the k), plain random 18.0 ns (a softmax and a seeded multinomial over the whole
vocabulary), top-p alone 81 ns (a full-vocabulary sort); the penalties add 0.6-2 ns and 24-26 us a row
(their hit entries' gather).

A run's settings are priced as the shipped terms + (its path's fit - the reference path's fit), both
from the same measurement, so only the difference between paths rests on it. Settings left at their
defaults (`SamplerSettings()`, as a replay of a real run passes) price the terms alone: for the shipped
terms that is SiPipe's path, for a profile fitted from runs (testbed/calibrate/cpu_sampling_fit.py) the
path those runs took; explicit settings move a fitted profile's terms as if they were SiPipe's path, so
refit from runs that sampled as the study does instead.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from engine.base.sampling import SamplerSettings

MEASURED = Path(__file__).parent / "measured" / "cpu_sampler_paths.json"
REFERENCE_PATH = "top_k_penalties"  # the path of the shipped `cpu_sample_*` terms (SiPipe's settings)


def cpu_path(s: SamplerSettings, vocab: int) -> str:
    """The sampler's path for `s` (engine/torch_exec/stage/sampling.py `sample`, `candidate_probs`):
    greedy at temperature 0; else top-k when 0 < k < vocabulary, else top-p's sort when p < 1, else
    a draw over the whole vocabulary; `_penalties` when any penalty is on."""
    if s.greedy:
        base = "greedy"
    elif 0 < s.top_k < vocab:
        base = "top_k"
    elif s.top_p < 1.0:
        base = "top_p"
    else:
        base = "random"
    return f"{base}_penalties" if s.penalties else base


@lru_cache(maxsize=1)
def _fits() -> dict[str, dict[str, float]]:
    return json.loads(MEASURED.read_text())["fit"]


@lru_cache(maxsize=64)
def path_delta_s(s: SamplerSettings, vocab: int) -> tuple[float, float]:
    """(fixed, per row) seconds the path of `s` costs more (or less) than the reference path, for
    rows of `vocab` entries."""
    fits = _fits()
    path, ref = fits[cpu_path(s, vocab)], fits[REFERENCE_PATH]
    fixed = path["cpu_sample_fixed_s"] - ref["cpu_sample_fixed_s"]
    per_row = (path["cpu_sample_per_row_s"] - ref["cpu_sample_per_row_s"]
               + (path["cpu_sample_per_token_vocab_s"] - ref["cpu_sample_per_token_vocab_s"]) * vocab)
    return fixed, per_row
