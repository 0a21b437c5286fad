"""`testbed capacity --base-url URL`: the same search with `testbed bench serve` as the probe,
against any OpenAI-compatible server (this project's `testbed serve`, vLLM, SGLang, ...).

Each probe replays the workload at `workload.rate=<r>` (with `capacity.duration_s`, the requests
arriving in warm-up + duration seconds; the first `capacity.warmup_s` seconds are sent but not
judged) and waits for every request to finish, so the next probe starts on an idle server. Probes
run one at a time (two at once would load the one server together). The server's own policy,
model and hardware are what is measured: only workload, SLO, seed and output keys may be set.
Times are in the server's seconds: with `--time-scale K` (a server whose clock runs K times faster,
`testbed serve executor=sim serve.time_scale=K`) a probe takes 1/K of its simulated duration.

Before any probe the server must answer `GET /v1/models` (else one `error:` line, exit 2), and it
serves the workload's lightest request alone and then its longest (which sets the steady-state
probe length when `capacity.duration_s` is not given, and the drain in the time estimate), so
that a point that cannot meet the SLO at any rate is said so at once. Each probe then checks its host: that the server kept up with its clock
(the paced simulator's `testbed_clock_lag_seconds` over `testbed_clock_completions` on /metrics:
mean lateness per completion at most `LAG_LIMIT` x slo.tpot_s; servers without the metric are not
checked: a lateness L delays a token by L, so it moves TTFT by L and a time between tokens by at
most L; the host's scheduling jitter, 4-5 ms of wall time per completion at load 13 on 2 cores,
stays below it at --time-scale 10, a server falling behind its clock does not), that the HTTP
path kept up (the client's mean TTFT less the server's own, from its TTFT histogram on /metrics,
at most the same limit: at load 19-23 the client's TTFT ran 0.3-0.4 s above the server's with the
clock check passing and the answer 45% low; 14-39 ms at load 4-6) and that the client sent at the offered rate (the span of its sends at most
1 / `SEND_RATE_LIMIT` of the schedule's, its p99 send lag at most `SEND_LAG_S`). On 2 shared cores
at host load 17-25 a served search reported 1.354 req/s where the simulator gave 4.00: client and
server were starved. A probe failing the check is run again (`capacity.retries`), then reported as
`host-bound` and never counted: the point's search stops there without a capacity.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.base.errors import ConfigError, TestbedError
from engine.core.metrics import SLO
from engine.core.request import Request
from testbed.sweep import jobs as sweep
import testbed.capacity.results as results
from testbed.capacity.command import HOST_BOUND, CapacityFeed
from testbed.capacity.settings import CapacitySettings
from testbed.capacity.steady import Unloaded
from testbed.config.overrides import merge

LIVE_KEYS = ("workload", "slo", "seed", "output", "data_dir")  # what a client may set; the rest is the server's
DRAIN_S = 10.0  # the estimate's allowance (server seconds) for a probe's drain when the longest request is unknown
PROBE_OVERHEAD_S = 1.0  # wall seconds per probe outside its requests (run directory, MLflow run), measured ~0.5-1
LAG_LIMIT = 0.25  # mean clock lag per completion, as a fraction of slo.tpot_s (50 ms at 0.2 s)
SEND_RATE_LIMIT = 0.95  # the client's send span may stretch the schedule's by 1/0.95 at most
SEND_LAG_S = 1.0  # p99 of (sent - scheduled), server seconds
REACH_TIMEOUT_S = 10.0


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
        if settings.criterion == "sarathi":
            raise ConfigError("invalid capacity.criterion=sarathi with --base-url: its median scheduling delay is "
                              "the server's, which a client cannot see; valid choices: attainment, tpot_p99, "
                              "tbt_p99, ttft_p99")

    def reach(self) -> None:
        """The server answers GET /v1/models, or one clear error before any probe."""
        import httpx

        url = self.base_url.rstrip("/") + "/v1/models"
        try:
            resp = httpx.get(url, timeout=REACH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise TestbedError(f"cannot reach --base-url {self.base_url}: {type(exc).__name__}: {exc}; start the "
                               f"server or correct the URL (no probe was sent)") from None
        if resp.status_code != 200:
            raise TestbedError(f"--base-url {self.base_url} refused GET /v1/models with HTTP {resp.status_code}; "
                               f"an OpenAI-compatible server answers it (no probe was sent)")

    def unloaded(self, run: Any, retries: int = 0) -> Unloaded:
        """The workload's lightest and longest request served alone, in the server's seconds (the
        longest sets the steady-state probe length and the drain in the time estimate); served
        again, like a probe, while the host check flags it (`capacity.retries`): at load 8.5 one
        flag of 55 ms against the 50 ms limit left the search without any answer."""
        for _ in range(retries):
            u = self._unloaded(run)
            if u.error is None or not u.error.startswith(HOST_BOUND):
                return u
        return self._unloaded(run)

    def _unloaded(self, run: Any) -> Unloaded:
        from testbed.bench.serve import replay, request_rows
        from workloads.base import build_workload

        requests = build_workload(run.workload, run.data_dir)
        picks = [min(requests, key=lambda r: (r.output_len < 2, r.prompt_len, r.output_len)),
                 max(requests, key=lambda r: (r.output_len, r.prompt_len))]
        rows = []
        before = server_counters(self.base_url)
        for r in picks:
            outcomes, _ = asyncio.run(replay(self.base_url, [Request(0, 0.0, r.prompt_len, r.output_len)],
                                             endpoint=self.endpoint, model=self.model, time_scale=self.time_scale,
                                             vocab=self.vocab, seed=run.settings.seed))
            row = request_rows(outcomes, self.time_scale)[0]
            if row["status"] != "finished":
                raise TestbedError(f"--base-url {self.base_url} failed one request served alone: {row['fail_reason']}")
            rows.append(row)
        starved = host_check(before, server_counters(self.base_url), rows, run.settings.slo)
        return Unloaded(rows[0]["ttft_s"], rows[0]["tpot_s"], rows[-1]["e2el_s"],
                        f"{HOST_BOUND} before any probe: {starved}" if starved else None)

    def feed(self, p: Any, parent: sweep.ParentRun) -> LiveFeed:
        return LiveFeed(p, parent, self)

    def estimate_s(self, p: Any, feed: CapacityFeed) -> float:
        """Wall seconds for the planned probes: each sends for warm-up + duration and drains, in
        server seconds over the time scale, plus `PROBE_OVERHEAD_S`.

        The drain is the longest request's unloaded end-to-end time plus the wait for a first token
        that the SLO allows (slo.ttft_s, or the target of a ttft_p99 criterion): a search's probes
        straddle the capacity, where the last requests arrive into a steady-state queue whose first
        tokens the criterion holds near that bound, then decode about as fast as alone (the batch
        empties once arrivals stop). Measured (docs/capacity.md's live search, 128-token outputs,
        5.3 s alone, 4 s TTFT bound): the last request finished 5.8 s after the last arrival at 2
        req/s, 8.1 at 3.36, 9.4 at 3.67 (capacity 3.51; the last to finish waited 3.4 s for its first
        token, then ran 47 ms per token against ~40 alone), 13.7 at 4 (overloaded): 8.7 s on
        average over the search's 7 probes against 9.3 modelled. With the unloaded time alone (and
        a plan one probe short) the estimate at the start ran 28-32% low."""
        s = p.settings
        total = 0.0
        for pt in p.points:
            if pt.pruned:
                continue
            e2e = pt.unloaded.e2e_s if pt.unloaded is not None and math.isfinite(pt.unloaded.e2e_s) else DRAIN_S
            wait = pt.target if s.criterion == "ttft_p99" else pt.run.settings.slo.ttft_s
            probes = feed.searches[pt.index].planned()
            if getattr(pt, "window", 0) == 0 and not getattr(pt, "holdout", False):  # the point's checks: upper, hold-out, the others
                probes += 1 + len(p.windows_of(pt.group)) if hasattr(p, "windows_of") else 2
            total += probes * ((s.warmup_s + pt.duration_s + e2e + wait) / self.time_scale + PROBE_OVERHEAD_S)
        return total

    def print_estimate(self, console: Any, p: Any, feed: LiveFeed) -> None:
        total = feed.estimate_s
        took = f"{total / 60:.1f} min" if total >= 120 else f"{total:.0f} s"
        console.print(f"against {self.base_url}: ~{feed.planned()} probes, each sending for warm-up + duration and "
                      f"draining for about the longest request alone plus the SLO's wait for a first token; "
                      f"roughly {took} at --time-scale {self.time_scale:g}", highlight=False)


def options(args: argparse.Namespace) -> LiveOptions | None:
    """The client options of `testbed capacity`; None without --base-url (they must not be set then)."""
    from testbed.bench.serve import DEFAULT_VOCAB, check_client_arguments

    if not args.base_url:
        defaults = (("--endpoint", args.endpoint, "completions"), ("--model", args.model, None),
                    ("--time-scale", args.time_scale, 1.0), ("--max-concurrency", args.max_concurrency, None),
                    ("--label", args.label, "served"), ("--vocab-size", args.vocab_size, DEFAULT_VOCAB))
        given = [flag for flag, value, default in defaults if value != default]
        if given:
            raise ConfigError(f"{given[0]} is an option of a live search; add --base-url URL")
        return None
    if not args.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"invalid --base-url {args.base_url!r}: must start with http:// or https://")
    if not args.time_scale > 0:
        raise ConfigError(f"invalid --time-scale {args.time_scale}: must be > 0")
    check_client_arguments(args)
    return LiveOptions(args.base_url, args.endpoint, args.model, args.time_scale, args.vocab_size,
                       args.max_concurrency, args.label)


class LiveFeed(CapacityFeed):
    """CapacityFeed whose probes are `testbed bench serve` runs against the server, in this process."""

    def __init__(self, p: Any, parent: sweep.ParentRun, live: LiveOptions) -> None:
        super().__init__(p, parent)
        self.live = live
        self.estimate_s = live.estimate_s(p, self)
        self.walls: list[float] = []  # wall seconds per run of each probe done
        self.spent_s = 0.0  # wall seconds of the probes done, reruns included
        self.left_s = self.estimate_s

    def follow(self, row: dict) -> list[sweep.Job]:
        """The search's next probe, and the time left re-estimated from the probes' measured walls
        (the first such estimate is kept: `measured_estimate_s`)."""
        jobs = super().follow(row)
        # per probe run: a probe run again for its host check counts twice (the estimate after a
        # rerun first probe ran 41% high when its two runs were taken for one probe)
        wall = float(row.get("wall_s") or 0.0)
        self.spent_s += wall
        self.walls.append(wall / max(1, int(row.get("attempts") or 1)))
        per = sum(self.walls) / len(self.walls)
        self.left_s = per * max(0, self.planned() - len(self.walls))
        if len(self.walls) == 1:
            self.measured_estimate_s = self.spent_s + self.left_s
        return jobs

    def describe(self, row: dict, job: sweep.Job) -> str:
        return super().describe(row, job) + f" · ~{self.left_s:.0f} s left"

    def run(self, job: sweep.Job) -> dict:
        """The probe; run again (up to capacity.retries times) while its host check fails."""
        from testbed.bench.serve import run_bench_serve

        pt = self.p.points[self.owner[job.index]]
        wl = job.spec.workload
        ovs = merge(pt.overrides, [f"workload.rate={wl.rate}", f"workload.num_requests={wl.num_requests}"])
        o = self.live
        t0 = time.perf_counter()
        for attempt in range(self.p.settings.retries + 1):
            row: dict[str, Any] = {"point": job.index, **job.axis_values, "status": "failed", "error": None,
                                   "run_id": None, "run_dir": None}
            before = server_counters(o.base_url)
            result, run_dir = run_bench_serve(
                o.base_url, ovs, endpoint=o.endpoint, model=o.model, time_scale=o.time_scale, vocab=o.vocab,
                max_concurrency=o.max_concurrency, label=o.label, requests=job.requests, tags=sweep.point_tags(job),
                experiment=job.experiment, run_dir=Path(job.run_dir + (f"_retry{attempt}" if attempt else "")))
            row.update(run_id=result.info.get("run_id"), run_dir=str(run_dir), attempts=attempt + 1)
            sweep.fill_row(row, result)
            after = server_counters(o.base_url)
            if not result.error:  # judged from the result in memory: the probe need not keep requests.csv
                row["judged"] = results.judge(job.spec.settings.slo, self.p.settings.warmup_s, wl.rate, result)
            row["host_flag"] = host_check(before, after, result.requests, job.spec.settings.slo)
            row["ttft_path_s"] = ttft_path_s(before, after, result.requests)
            if not row["host_flag"] or result.error:
                break
        row["wall_s"] = time.perf_counter() - t0
        return row


@dataclass(frozen=True)
class ServerCounters:
    """Running sums on the server's /metrics, read before and after a probe (None: not published)."""

    lag_s: float | None = None  # testbed_clock_lag_seconds: how late completions reached the paced controller
    completions: float | None = None  # testbed_clock_completions
    ttft_sum_s: float | None = None  # <prefix>_time_to_first_token_seconds_sum (testbed, vllm: ...)
    ttft_count: float | None = None  # ... _count


def server_counters(base_url: str) -> ServerCounters | None:
    """The server's clock lag and its own TTFT histogram from /metrics; None without Prometheus text."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=REACH_TIMEOUT_S).text
        values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    except Exception:  # no Prometheus text there: another server, nothing to check
        return None
    ttft = [name[:-len("_sum")] for name in values if name.endswith("time_to_first_token_seconds_sum")]
    return ServerCounters(values.get("testbed_clock_lag_seconds_total"), values.get("testbed_clock_completions_total"),
                          values.get(ttft[0] + "_sum") if ttft else None, values.get(ttft[0] + "_count") if ttft else None)


def _delta(before: ServerCounters | None, after: ServerCounters | None, total: str, count: str) -> float | None:
    """Mean per counted event of `total` between two scrapes (None: not published, or no event)."""
    if before is None or after is None or None in (getattr(before, total), getattr(after, total),
                                                   getattr(before, count), getattr(after, count)):
        return None
    n = getattr(after, count) - getattr(before, count)
    return (getattr(after, total) - getattr(before, total)) / n if n > 0 else None


def ttft_path_s(before: ServerCounters | None, after: ServerCounters | None, rows: list[dict]) -> float | None:
    """The client's mean TTFT less the server's own over the same probe (server seconds): the time
    the HTTP path and the client added to each first token (None: the server publishes no TTFT)."""
    server = _delta(before, after, "ttft_sum_s", "ttft_count")
    client = [float(r["ttft_s"]) for r in rows if r.get("status") == "finished" and r.get("ttft_s") is not None]
    return None if server is None or not client else float(np.mean(client)) - server


def host_check(before: ServerCounters | None, after: ServerCounters | None, rows: list[dict], slo: SLO) -> str:
    """Why this probe measured its host rather than the server ('' when it did not)."""
    reasons = []
    limit = LAG_LIMIT * slo.tpot_s
    lag = _delta(before, after, "lag_s", "completions")
    if lag is not None and lag > limit:
        reasons.append(f"the server ran {lag * 1000:.0f} ms behind its clock per completion "
                       f"(limit {limit * 1000:.0f} ms)")
    path = ttft_path_s(before, after, rows)
    if path is not None and path > limit:
        reasons.append(f"the client saw first tokens {path * 1000:.0f} ms after the server produced them, "
                       f"on average (limit {limit * 1000:.0f} ms)")
    sent = np.array([r["arrival_s"] for r in rows], dtype=float)
    planned = np.array([r["scheduled_s"] for r in rows], dtype=float)
    if sent.size > 1 and np.ptp(planned) > 0:
        ratio = np.ptp(planned) / np.ptp(sent)
        late = float(np.percentile(sent - planned, 99))
        if ratio < SEND_RATE_LIMIT or late > SEND_LAG_S:
            reasons.append(f"the client sent at {ratio:.0%} of the offered rate, p99 {late:.2g} s late")
    return "; ".join(reasons)
