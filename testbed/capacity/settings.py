"""`capacity.*` overrides -> `CapacitySettings`, and how one probe is judged against them.

The keys are split off before `compose` (like `compare.*`): how a search is run does not change
what a probe computes. The SLO itself is the run config's `slo.ttft_s` / `slo.tpot_s` (defaults:
gLLM's Azure SLO, 4 s and 0.2 s, for every workload), so a probe's `slo_attainment` is the same
number `testbed run` prints.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


from engine.base.errors import ConfigError
from engine.core.metrics import SLO
from engine.base.typed import setting
from testbed.config.overrides import MAX_WORKERS, check_keys, parse_settings, scalar
from workloads.arrivals import MAX_RATE

CRITERIA = ("attainment", "tpot_p99", "tbt_p99", "ttft_p99", "sarathi")
# criterion -> (the probe's metric, True when higher is better, the slo.* key of its default target)
CRITERION_METRIC = {"attainment": ("slo_attainment", True, None), "tpot_p99": ("tpot_p99_s", False, "tpot_s"),
                    "tbt_p99": ("itl_p99_s", False, "tpot_s"), "ttft_p99": ("ttft_p99_s", False, "ttft_s"),
                    "sarathi": ("itl_p99_s", False, "tpot_s")}
DEFAULT_ATTAINMENT = 0.8  # gLLM's "80% SLO attainment"
# Sarathi-Serve (OSDI'24) defines capacity as the highest load (QPS) that meets the SLO on the P99
# time between tokens while the median scheduling delay (arrival to first scheduled) stays at or
# under 2 s: the defaults of its public capacity search (sarathi/benchmark/capacity_search: P50
# scheduling delay <= 2.0 s and P99 TBT <= 0.2 s, the decode tokens of all requests pooled, each
# decode's execution plus any preemption). `capacity.criterion=sarathi`; the TBT bound is slo.tpot_s.
SARATHI_MAX_MEDIAN_DELAY_S = 2.0
DELAY_METRIC = "sched_delay_p50_s"  # arrival to first scheduled, median over the judged requests
PRICE_PREFIX = "price."  # capacity.price.<hardware>=<USD per GPU-hour>


MAX_DURATION_S = 86_400.0  # a probe of at most a day of arrivals (1e12 s ran with no end)
MAX_PROBE_REQUESTS = 1_000_000  # requests of one probe at most (rate x duration)
MAX_GPUS = 1024  # a GPU budget: its layouts are the powers of two of P and TP within it


@dataclass(frozen=True)
class CapacitySettings:
    """One search per grid point and window: bracket (x`growth` from `start`), then bisect until
    the bracket is within `precision` (relative); the point's capacity is the lowest of its
    windows' (testbed/capacity/cover.py), then confirmed: every window run at it, the binding
    window at capacity x (1 + precision) (must fail), and a held-out stretch at it (must pass;
    else it becomes a window and the search narrows, up to `holdouts` hold-outs and
    `narrow_probes` probes after the first failed confirmation). A trace window is
    `window_requests` contiguous requests of the trace at their own gaps, rescaled;
    `windows` of them cover the trace (None) or are spread over it; `gpus` makes it a
    configuration search within that budget."""

    criterion: str = setting("attainment", choices=CRITERIA)
    target: float | None = setting(None, gt=0)  # None: 0.8 attainment, or slo.tpot_s / slo.ttft_s
    precision: float = setting(0.02, min=0.002, lt=1)  # stop when (hi - lo) / lo <= precision
    start: float | None = setting(None, gt=0, max=MAX_RATE)  # None: the workload's rate (else 1 req/s)
    growth: float = setting(2.0, gt=1, max=100)  # bracketing factor
    min_rate: float = setting(0.01, gt=0, max=MAX_RATE)
    max_rate: float = setting(1000.0, gt=0, max=MAX_RATE)
    max_probes: int = setting(20, min=2, max=200)  # per point and window
    confirm: int = setting(0, min=0, max=5)  # extra probes above a window's converged bracket (non-monotone check)
    holdouts: int = setting(4, min=1, max=10)  # held-out stretches tried before an answer is called unconfirmed
    narrow_probes: int = setting(24, min=0, max=200)  # probes after a failed confirmation, at most (narrowing)
    duration_s: float | None = setting(None, gt=0, max=MAX_DURATION_S)  # None: a trace window / the steady-state length
    steady_factor: float = setting(8.0, min=1, max=100)  # auto length: this x the longest request's unloaded E2E
    min_duration_s: float = setting(300.0, gt=0, max=MAX_DURATION_S)  # auto length: at least this many seconds
    window_requests: int = setting(4000, min=2, max=MAX_PROBE_REQUESTS)  # a trace window: this many requests
    warmup_s: float = setting(0.0, min=0, max=MAX_DURATION_S)  # requests arriving earlier are sent but not judged
    windows: int | None = setting(None, min=1, max=20)  # None: trace windows covering the trace (3 seeds otherwise)
    gpus: int | None = setting(None, min=1, max=MAX_GPUS)  # a GPU budget: configurations of at most this many GPUs, as replicas
    early_stop: bool = True  # end a search probe once its attainment cannot reach the target (capacity/early.py)
    retries: int = setting(1, min=0, max=5)  # live: reruns of a probe the host could not keep up with
    workers: int | None = setting(None, min=1, max=MAX_WORKERS)  # None: one per CPU core
    experiment: str | None = None  # MLflow experiment and folder; None: capacity-<UTC time>
    prices: tuple[tuple[str, float], ...] = ()  # (hardware, USD per GPU-hour) from capacity.price.<hw>=

    def __post_init__(self) -> None:
        if self.min_rate >= self.max_rate:
            raise ConfigError(f"invalid capacity.min_rate={self.min_rate:g}: must be below capacity.max_rate="
                              f"{self.max_rate:g}")
        if self.criterion == "attainment" and self.target is not None and self.target > 1:
            raise ConfigError(f"invalid capacity.target={self.target:g}: an attainment is a fraction in (0, 1]")
        if self.warmup_s and self.metric == "itl_p99_s":
            raise ConfigError(f"invalid capacity.warmup_s={self.warmup_s:g} with capacity.criterion={self.criterion}: "
                              f"the time between tokens is judged over every request (set capacity.warmup_s=0)")
        if self.duration_s is not None and self.warmup_s >= self.duration_s:
            raise ConfigError(f"invalid capacity.warmup_s={self.warmup_s:g}: a probe's warm-up must be shorter than "
                              f"the probe (capacity.duration_s={self.duration_s:g}), or nothing is judged")
        if self.experiment is not None and (not self.experiment.strip() or "/" in self.experiment
                                            or self.experiment.startswith(".")):
            raise ConfigError(f"invalid capacity.experiment={self.experiment!r}: a name without '/'")

    @property
    def metric(self) -> str:
        return CRITERION_METRIC[self.criterion][0]

    @property
    def higher_is_better(self) -> bool:
        return CRITERION_METRIC[self.criterion][1]

    def resolved_target(self, slo: SLO) -> float:
        if self.target is not None:
            return self.target
        key = CRITERION_METRIC[self.criterion][2]
        return DEFAULT_ATTAINMENT if key is None else float(getattr(slo, key))

    def probe_text(self, durations: Sequence[float], window_requests: int | None = None) -> str:
        """What one probe sends: a trace window of `window_requests` requests at the probed rate,
        else seconds of arrivals (per point when set by the steady-state rule)."""
        warm = f" (the first {self.warmup_s:g} s not judged)" if self.warmup_s else ""
        if window_requests:
            return f"{window_requests:,} contiguous requests of the trace, their own gaps rescaled to the rate{warm}"
        lo, hi = min(durations), max(durations)
        span = f"{lo:.0f} s" if hi - lo < 0.5 else f"{lo:.0f}-{hi:.0f} s"
        how = "" if self.duration_s else f" (steady state: {self.steady_factor:g} x the longest unloaded request)"
        return span + (f" + {self.warmup_s:g} s warm-up" if self.warmup_s else "") + " of arrivals" + how

    def describe(self, target: float) -> str:
        op = ">=" if self.higher_is_better else "<="
        extra = f" and {DELAY_METRIC} <= {SARATHI_MAX_MEDIAN_DELAY_S:g}" if self.criterion == "sarathi" else ""
        return f"{self.metric} {op} {target:g}{extra}"

    def passes(self, value: float, target: float, metrics: Mapping[str, float] | None = None) -> bool:
        """The criterion's bound, and for the Sarathi preset the median scheduling delay too."""
        if value is None or math.isnan(value):
            return False
        if self.criterion == "sarathi" and not (metrics or {}).get(DELAY_METRIC, math.inf) <= SARATHI_MAX_MEDIAN_DELAY_S:
            return False
        return value >= target if self.higher_is_better else value <= target

    @property
    def resolved_workers(self) -> int:
        import os

        return self.workers or os.cpu_count() or 1


KEYS = tuple(f for f in CapacitySettings.__dataclass_fields__ if f != "prices")


def parse(raw: Mapping[str, str]) -> CapacitySettings:
    """`capacity.*` strings -> settings; `capacity.price.<hardware>=<usd>` -> `prices`."""
    check_keys(raw, KEYS, "capacity", prefixes=(PRICE_PREFIX,))
    prices = tuple((k[len(PRICE_PREFIX):], _price(k, v)) for k, v in raw.items() if k.startswith(PRICE_PREFIX))
    plain = {k: v for k, v in raw.items() if not k.startswith(PRICE_PREFIX)}
    return replace(parse_settings(CapacitySettings, plain, "capacity"), prices=prices)


def _price(key: str, raw: str) -> float:
    value = scalar(raw)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"invalid capacity.{key}={raw!r}: must be a price > 0 (USD per GPU-hour)")
    return float(value)


def check_prices(settings: CapacitySettings, hardware: Sequence[str]) -> None:
    """A price for a hardware the grid does not use is a typo, not a no-op."""
    for name, _ in settings.prices:
        if name not in hardware:
            raise ConfigError(f"capacity.price.{name}: hardware {name!r} is not in this grid; "
                              f"valid choices: {', '.join(sorted(set(hardware)))}")
