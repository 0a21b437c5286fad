"""`testbed capacity --base-url URL`: the same search with `testbed bench serve` as the probe,
against any OpenAI-compatible server (this project's `testbed serve`, vLLM, SGLang, ...).

Each probe replays the workload at `workload.rate=<r>` (with `capacity.duration_s`, the requests
arriving in warm-up + duration seconds; the first `capacity.warmup_s` seconds are sent but not
judged) and waits for every request to finish, so the next probe starts on an idle server. Probes
run one at a time (two at once would load the one server together). The server's own policy,
model and hardware are what is measured: only workload, SLO, seed and output keys may be set.
Times are in the server's seconds: with `--time-scale K` (a server whose clock runs K times faster,
`testbed serve executor=sim serve.time_scale=K`) a probe takes 1/K of its simulated duration.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError
from testbed.sweep import jobs as sweep
from testbed.capacity.command import CapacityFeed
from testbed.capacity.settings import CapacitySettings
from testbed.config.overrides import merge

LIVE_KEYS = ("workload", "slo", "seed", "output", "data_dir")  # what a client may set; the rest is the server's
DRAIN_S = 10.0  # a rough allowance per probe for the last requests to finish (the estimate only)


@dataclass(frozen=True)
class LiveOptions:
    base_url: str
    endpoint: str = "completions"
    model: str | None = None
    time_scale: float = 1.0
    vocab: int = 32000
    max_concurrency: int | None = None
    label: str = "served"

    def check(self, overrides: list[str], settings: CapacitySettings) -> None:
        for ov in overrides:
            key = ov.partition("=")[0].lstrip("+~")
            if key.split(".", 1)[0] not in LIVE_KEYS:
                valid = ", ".join(k + ".*" if k in ("workload", "slo", "output") else k for k in LIVE_KEYS)
                raise ConfigError(f"{ov}: with --base-url the server's own policy, model and hardware are measured; "
                                  f"valid keys: {valid}")
        if settings.workers is not None and settings.workers > 1:
            raise ConfigError(f"invalid capacity.workers={settings.workers} with --base-url: the probes of one "
                              f"server run one at a time (capacity.workers=1)")

    def feed(self, p: Any, parent: sweep.ParentRun) -> LiveFeed:
        return LiveFeed(p, parent, self)

    def print_estimate(self, console: Any, p: Any, feed: CapacityFeed) -> None:
        s = p.settings
        rate = feed.searches[0].start
        per = (s.warmup_s + s.duration_s) if s.duration_s else p.run0.workload.num_requests / rate
        total = feed.planned() * (per + DRAIN_S) / self.time_scale
        took = f"{total / 60:.0f} min" if total >= 120 else f"{total:.0f} s"
        console.print(f"against {self.base_url}: each probe sends for ~{per:.0f} server-seconds (at "
                      f"{rate:g} req/s) + the drain; ~{feed.planned()} probes = roughly {took} at "
                      f"--time-scale {self.time_scale:g}", highlight=False)


def options(args: argparse.Namespace) -> LiveOptions | None:
    """The client options of `testbed capacity`; None without --base-url (they must not be set then)."""
    if not args.base_url:
        defaults = (("--endpoint", args.endpoint, "completions"), ("--model", args.model, None),
                    ("--time-scale", args.time_scale, 1.0), ("--max-concurrency", args.max_concurrency, None),
                    ("--label", args.label, "served"))
        given = [flag for flag, value, default in defaults if value != default]
        if given:
            raise ConfigError(f"{given[0]} is an option of a live search; add --base-url URL")
        return None
    if not args.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"invalid --base-url {args.base_url!r}: must start with http:// or https://")
    if not args.time_scale > 0:
        raise ConfigError(f"invalid --time-scale {args.time_scale}: must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"invalid --max-concurrency {args.max_concurrency}: must be >= 1")
    return LiveOptions(args.base_url, args.endpoint, args.model, args.time_scale, args.vocab_size,
                       args.max_concurrency, args.label)


class LiveFeed(CapacityFeed):
    """CapacityFeed whose probes are `testbed bench serve` runs against the server, in this process."""

    def __init__(self, p: Any, parent: sweep.ParentRun, live: LiveOptions) -> None:
        super().__init__(p, parent)
        self.live = live

    def run(self, job: sweep.Job) -> dict:
        from testbed.bench.serve import run_bench_serve

        pt = self.p.points[self.owner[job.index]]
        wl = job.spec.workload
        sized = [f"workload.num_requests={wl.num_requests}"] if self.p.settings.duration_s else []
        ovs = merge(pt.overrides, [f"workload.rate={wl.rate}", *sized])
        tags = sweep.point_tags(job)
        row: dict[str, Any] = {"point": job.index, **job.axis_values, "status": "failed", "error": None,
                               "run_id": None, "run_dir": None}
        t0 = time.perf_counter()
        o = self.live
        result, run_dir = run_bench_serve(o.base_url, ovs, endpoint=o.endpoint, model=o.model, time_scale=o.time_scale,
                                          vocab=o.vocab, max_concurrency=o.max_concurrency, label=o.label, tags=tags,
                                          experiment=job.experiment, run_dir=Path(job.run_dir))
        row.update(run_id=result.info.get("run_id"), run_dir=str(run_dir))
        sweep.fill_row(row, result)
        row["wall_s"] = time.perf_counter() - t0
        return row
