"""GPU sampling's radix sort fitted to a measurement on a GPU (issue 46 item 2; declared in
docs/measurements/sampling-sort-2026-11-29.md before the fit).

`scripts/measure_gpu_sampler.py` times, on a GPU, the kernels engine/pricing/sampling_ops.py lists for
each sampling setting. Compared as the extra over the reference path (what the host tables' fit does
not hold), the full-vocabulary sort of top-k / top-p was priced at half its time on the H200: each
radix pass priced as a stream at the element-wise rate, where its scattered writes run slower. This
fits that pass rate (`SORT_EFFICIENCY`, a fraction of the element-wise rate) on the declared fit
points, with the device's own bandwidth and the kernel efficiencies of the profile named.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.pricing.hardware import get_hardware
from engine.pricing.kernel_coefficients import KernelCoefficients
from engine.pricing.sampling_ops import SamplerSettings, kernels_s

# what measure_gpu_sampler.py ran (its SETTINGS), and the declared split (rows 32: launch-bound, out)
SETTINGS = {
    "reference": SamplerSettings(),
    "top_p_top_k": SamplerSettings(0.8, 50, 0.95),
    "all": SamplerSettings(0.8, 50, 0.95, 1.1, 0.1, 0.1),
}
FIT = ("top_p_top_k", (256, 512))
TEST = ("all", (256, 512))
H200_BW_BPS = 4.8e12  # HBM3e, NVIDIA's H200 SXM data sheet


@dataclass(frozen=True)
class SamplerPoints:
    """The measured seconds by (setting, rows, vocab), and how to price them."""

    measured: dict[tuple[str, int, int], float]
    bw_Bps: float
    kernels: KernelCoefficients

    @classmethod
    def read(cls, path: Path, bw_Bps: float = H200_BW_BPS, profile: str = "h100-80g") -> SamplerPoints:
        rec = json.loads(Path(path).read_text())
        measured = {(p["setting"], int(p["rows"]), int(p["vocab"])): float(p["measured_s"]) for p in rec["points"]}
        hw = get_hardware(profile)
        return cls(measured, bw_Bps, KernelCoefficients.from_mapping(hw.kernels))

    def keys(self, split: tuple[str, tuple[int, ...]]) -> list[tuple[str, int, int]]:
        name, rows = split
        return sorted(k for k in self.measured if k[0] == name and k[1] in rows)

    def extra(self, key: tuple[str, int, int], sort_eff: float) -> tuple[float, float]:
        """(priced, measured) seconds over the reference path at `key`'s rows and vocabulary."""
        name, rows, vocab = key
        k = self.kernels

        def priced(s: SamplerSettings) -> float:
            return kernels_s(s, rows, vocab, 2, self.bw_Bps, k.add_efficiency, k.norm_efficiency,
                             k.elementwise_floor_s, sort_eff)

        return (priced(SETTINGS[name]) - priced(SETTINGS["reference"]),
                self.measured[key] - self.measured[("reference", rows, vocab)])

    def errors(self, split: tuple[str, tuple[int, ...]], sort_eff: float) -> list[float]:
        return [p / m - 1 for p, m in (self.extra(k, sort_eff) for k in self.keys(split))]


def fit_sort_efficiency(points: SamplerPoints) -> float:
    """The pass rate minimising the fit points' squared relative error (golden-section search on
    (0.05, 1]: the priced extra falls as the rate rises, so the error is unimodal)."""
    lo, hi = 0.05, 1.0
    g = (5 ** 0.5 - 1) / 2

    def loss(e: float) -> float:
        return sum(x * x for x in points.errors(FIT, e))

    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    for _ in range(80):
        if loss(a) < loss(b):
            hi, b = b, a
            a = hi - g * (hi - lo)
        else:
            lo, a = a, b
            b = lo + g * (hi - lo)
    return round((lo + hi) / 2, 4)
