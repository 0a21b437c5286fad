"""`testbed bench serve`: replay a workload against any OpenAI-compatible server.

    testbed bench serve --base-url http://127.0.0.1:8000 workload=azure workload.num_requests=200

Each request of the workload (workloads/, the same config keys as `testbed run`) is sent at its
arrival time (divided by `--time-scale`, for a server whose clock runs that much faster, e.g.
`testbed serve executor=sim serve.time_scale=10`), to `/v1/completions` with its prompt as a
list of token ids of exactly `prompt_len` (the workload's own ids, else deterministic ids from
(seed, request id), as the torch executor derives them), `max_tokens = output_len` and
`ignore_eos` (vLLM's extension) so every request generates exactly its output length, streamed
with `stream_options.include_usage`. `--endpoint chat` sends the prompt as text instead (token
counts then depend on the server's tokenizer).

Per request, from the stream, with vLLM's benchmark definitions (benchmarks/benchmark_serving.py):
TTFT = first chunk with text - send; ITL = gaps between successive text chunks; E2EL = last
chunk - send; TPOT = (E2EL - TTFT) / (output tokens - 1). Times are multiplied by `--time-scale`
so they read in the server's (simulated) seconds. The summary has `testbed run`'s keys (throughput
over first send to last completion; engine-side keys such as bubble_ratio are null, a client
cannot see them) plus `itl_*` and `goodput_req_s` (finished requests meeting `slo.ttft_s` and
`slo.tpot_s`, per second). Outputs: `requests.csv`, `summary.json`, `config.yaml` under
`<output.dir>/<run name>`, and an MLflow run tagged `mode=bench-serve` beside offline runs.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.base.errors import ConfigError
from engine.core.metrics import SLO, SUMMARY_KEYS
from engine.core.request import Request
from engine.core.trace import Tracer

DEFAULT_VOCAB = 32000
PROGRESS_INTERVAL_S = 10.0  # without a terminal: one progress line this often
# config groups that describe the server, not this client: their values are the client's defaults,
# so the run's params carry the server's own (ServerSetup.params) instead
SERVER_GROUPS = ("model", "hardware", "policy", "executor", "parallel", "kv", "cost", "runtime", "link", "serve")


@dataclass
class Outcome:
    """What the client saw of one request (times in the client's seconds since the start)."""

    request: Request
    sent_s: float = math.nan
    token_times: list[float] = field(default_factory=list)
    end_s: float = math.nan
    completion_tokens: int | None = None
    error: str = ""


def prompt_token_ids(req: Request, vocab: int, seed: int) -> list[int]:
    from engine.torch_exec.weights.checkpoint import prompt_ids  # numpy only; no torch

    return prompt_ids(req, vocab, seed)


def _payload(req: Request, model: str | None, endpoint: str, vocab: int, seed: int) -> dict:
    body = {"max_tokens": req.output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if model:
        body["model"] = model
    ids = prompt_token_ids(req, vocab, seed)
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt_text or " ".join(map(str, ids))}]
    else:
        body["prompt"] = ids
    return body


class ReplayProgress:
    """How far a replay is: a rich bar on a terminal (as `vllm bench serve` shows one), else one
    line every `interval_s` (a log file or CI gets no bar redraws; 145 s of silence before)."""

    def __init__(self, console, total: int, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.console, self.total, self.interval_s = console, total, interval_s
        self.done = self.failed = 0
        self.t0 = self.last = time.perf_counter()
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                                TimeElapsedColumn(), console=console, transient=True)
            self.task = self.bar.add_task("replay", total=total, failed="")

    def __enter__(self) -> ReplayProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif exc[0] is None:
            self.line()

    def finished(self, out: Outcome) -> None:
        self.done += 1
        self.failed += bool(out.error)
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, failed=f"{self.failed} failed" if self.failed else "")

    def tick(self) -> None:
        """Called about once a second: prints the line when `interval_s` has passed (no bar)."""
        now = time.perf_counter()
        if self.bar is None and now - self.last >= self.interval_s:
            self.last = now
            self.line()

    def line(self) -> None:
        self.console.print(f"bench serve: {self.done}/{self.total} requests done ({self.failed} failed), "
                           f"{time.perf_counter() - self.t0:.0f} s", highlight=False)


async def _ticker(progress: ReplayProgress | None) -> None:
    while progress is not None:
        await asyncio.sleep(1.0)
        progress.tick()


async def _one(client, url: str, body: dict, out: Outcome, t0: float, headers: dict,
               progress: ReplayProgress | None = None) -> None:
    try:
        await _send(client, url, body, out, t0, headers)
    finally:
        if progress is not None:
            progress.finished(out)


async def _send(client, url: str, body: dict, out: Outcome, t0: float, headers: dict) -> None:
    out.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return
                now = time.perf_counter() - t0
                for ch in chunk.get("choices") or ():
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if text:
                        out.token_times.append(now)
                if chunk.get("usage"):
                    out.completion_tokens = int(chunk["usage"]["completion_tokens"])
        out.end_s = time.perf_counter() - t0
        if not out.token_times:
            out.error = "the stream ended without a token"
    except Exception as exc:  # a refused connection, a timeout: this request failed, the run goes on
        out.error = f"{type(exc).__name__}: {exc}"[:300]


async def replay(base_url: str, requests: list[Request], *, endpoint: str = "completions", model: str | None = None,
                 time_scale: float = 1.0, vocab: int = DEFAULT_VOCAB, seed: int = 0, max_concurrency: int | None = None,
                 api_key: str | None = None, timeout_s: float = 3600.0,
                 progress: ReplayProgress | None = None) -> tuple[list[Outcome], float]:
    """Send every request at its (scaled) arrival time; returns the outcomes and the client's wall time."""
    import httpx

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    url = base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outcomes = [Outcome(r) for r in requests]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits) as client:
        if model is None:
            model = await _first_model(client, base_url, headers)
        bodies = [_payload(r, model, endpoint, vocab, seed) for r in requests]
        t0 = time.perf_counter()

        async def run(i: int) -> None:
            delay = requests[i].arrival_s / time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await _one(client, url, bodies[i], outcomes[i], t0, headers, progress)
            else:
                async with sem:
                    await _one(client, url, bodies[i], outcomes[i], t0, headers, progress)

        ticker = asyncio.create_task(_ticker(progress))
        try:
            await asyncio.gather(*(run(i) for i in range(len(requests))))
        finally:
            ticker.cancel()
        wall = time.perf_counter() - t0
    return outcomes, wall


async def _first_model(client, base_url: str, headers: dict) -> str | None:
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        data = resp.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:
        return None


@dataclass(frozen=True)
class ServerSetup:
    """What the server says it runs: `testbed serve` lists its model, hardware, executor, policy
    and P in `/v1/models` (entry key `testbed`); another server (vLLM) only its model id, and the
    rest is `unknown`, never this client's config defaults."""

    model_id: str | None
    tags: dict[str, str]

    def params(self) -> dict[str, str]:
        """The run's params for the server's side: `<group>.name` as `testbed run` logs them, and P."""
        t = self.tags
        return {"model.name": t["model"], "hardware.name": t["hardware"], "policy.name": t["policy"],
                "executor.name": t["executor"], "parallel.pp": t["pp"]}


def server_setup(base_url: str, api_key: str | None = None, label: str = "served") -> ServerSetup:
    """The first `/v1/models` entry of the server; `label` is the policy when the server names none."""
    import httpx

    from testbed.tracking.tracker import SETUP_TAGS

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    entry: dict = {}
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0).json().get("data") or []
        entry = data[0] if data and isinstance(data[0], dict) else {}
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    told = entry.get("testbed") if isinstance(entry.get("testbed"), dict) else {}
    model_id = entry.get("id")
    tags = {k: str(told.get(k, "unknown")) for k in SETUP_TAGS}
    if "model" not in told and model_id:
        tags["model"] = str(model_id)
    if "policy" not in told:
        tags["policy"] = label
    return ServerSetup(model_id, tags)


# --- per-request rows and the summary ----------------------------------------------------------------
def request_rows(outcomes: list[Outcome], time_scale: float = 1.0) -> list[dict]:
    """`testbed run`'s requests.csv columns (times in the server's seconds; `arrival_s` is when it
    was sent), plus `scheduled_s` (when the workload said to send it) and `itl_mean_s`."""
    k = time_scale
    rows = []
    for o in outcomes:
        r = o.request
        ok = not o.error
        n = o.completion_tokens if o.completion_tokens is not None else len(o.token_times)
        first = o.token_times[0] * k if o.token_times else math.nan
        end = o.end_s * k if ok else math.nan
        sent = o.sent_s * k
        ttft = first - sent if o.token_times else math.nan
        e2el = end - sent if ok else math.nan
        tpot = (e2el - ttft) / (n - 1) if ok and n > 1 else math.nan
        gaps = np.diff(o.token_times) * k if len(o.token_times) > 1 else np.array([])
        rows.append({
            "request_id": r.request_id, "arrival_s": sent, "scheduled_s": r.arrival_s,
            "prompt_len": r.prompt_len, "output_len": r.output_len,
            "status": "finished" if ok else "failed", "num_generated": n, "first_scheduled_s": math.nan,
            "first_token_s": first, "finish_s": end, "ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el,
            "num_preemptions": math.nan, "fail_reason": o.error, "output_token_ids": "",
            "itl_mean_s": float(gaps.mean()) if gaps.size else math.nan, "_itl": gaps,
        })
    return rows


def _stats(values) -> tuple[float, float, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return (math.nan, math.nan, math.nan)
    return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def summarize(rows: list[dict], slo: SLO) -> dict:
    fin = [r for r in rows if r["status"] == "finished"]
    first = min((r["arrival_s"] for r in rows), default=0.0)
    last = max((r["finish_s"] for r in fin), default=first)
    window = max(last - first, 0.0)
    prompt_tok = sum(r["prompt_len"] for r in fin)
    out_tok = sum(r["num_generated"] for r in fin)
    tt = _stats([r["ttft_s"] for r in fin])
    tp = _stats([r["tpot_s"] for r in fin if not math.isnan(r["tpot_s"])])
    ee = _stats([r["e2el_s"] for r in fin])
    itl = _stats(np.concatenate([r["_itl"] for r in fin]) if fin else [])
    good = sum(1 for r in fin if r["ttft_s"] <= slo.ttft_s and (math.isnan(r["tpot_s"]) or r["tpot_s"] <= slo.tpot_s))
    per_s = (lambda x: x / window) if window > 0 else (lambda x: 0.0)
    s = {k: math.nan for k in SUMMARY_KEYS}
    s.update({
        "num_requests": len(rows), "num_finished": len(fin), "num_failed": len(rows) - len(fin), "duration_s": window,
        "throughput_tok_s": per_s(prompt_tok + out_tok), "output_throughput_tok_s": per_s(out_tok),
        "request_throughput": per_s(len(fin)),
        "ttft_mean_s": tt[0], "ttft_p50_s": tt[1], "ttft_p99_s": tt[2],
        "tpot_mean_s": tp[0], "tpot_p50_s": tp[1], "tpot_p99_s": tp[2],
        "e2el_mean_s": ee[0], "e2el_p50_s": ee[1], "e2el_p99_s": ee[2],
        "slo_attainment": good / len(rows) if rows else 0.0,
        "stage_bubble_ratio": [], "stage_utilization": [], "num_microbatches": 0, "trace_spans_dropped": 0,
        "itl_mean_s": itl[0], "itl_p50_s": itl[1], "itl_p99_s": itl[2], "goodput_req_s": per_s(good),
    })
    return s


def run_bench_serve(base_url: str, overrides: list[str], *, endpoint: str = "completions", model: str | None = None,
                    time_scale: float = 1.0, vocab: int = DEFAULT_VOCAB, max_concurrency: int | None = None,
                    api_key: str | None = None, label: str = "served", requests: list[Request] | None = None,
                    tags: dict | None = None, experiment: str | None = None, run_dir: Path | None = None,
                    console=None):
    """Build the workload from the config overrides, replay it, write the run dir, log to MLflow
    (extra `tags`, `experiment`: for `testbed capacity`, whose probes these are). Returns
    (RunResult, run_dir); the MLflow run id is `info["run_id"]`. The run is tagged with the
    server's set-up (`ServerSetup`); with a `console`, the replay shows its progress there."""
    from testbed.config.spec import compose_spec
    from testbed.run.outputs import display_name, run_name, write_run_dir
    from testbed.run.runner import RunResult
    from workloads.base import build_workload

    if endpoint not in ("completions", "chat"):
        raise ConfigError(f"unknown endpoint {endpoint!r}; valid choices: completions, chat")
    if not time_scale > 0:
        raise ConfigError(f"invalid --time-scale {time_scale}: must be > 0")
    if not base_url.startswith(("http://", "https://")):
        raise ConfigError(f"invalid --base-url {base_url!r}: must start with http:// or https://")
    spec = compose_spec(overrides)
    slo = spec.settings.slo
    if requests is None:
        requests = build_workload(spec.workload, spec.data_dir)
    name = run_name(spec, who=label)  # not the policy: the server ran its own
    server = server_setup(base_url, api_key, label)
    tracker = run_id = None
    if spec.output.mlflow:
        from testbed.tracking.tracker import Tracker, run_tags

        tracker = Tracker(spec.output, experiment)
        params = {k: v for k, v in spec.params().items() if k.split(".", 1)[0] not in SERVER_GROUPS}
        # `testbed run`'s naming style, with the server's policy: `gllm · azure · rate=1 · bench-serve`
        shown = spec.output.run_name or " · ".join([server.tags["policy"], *display_name(spec).split(" · ")[1:],
                                                    "bench-serve"])
        run_id = tracker.start_flat({**params, **server.params()}, shown, {
            **run_tags(spec), **server.tags, "mode": "bench-serve", "base_url": base_url, **(tags or {})})
    try:
        t_wall = time.perf_counter()
        with ReplayProgress(console, len(requests)) if console is not None else nullcontext() as progress:
            outcomes, wall = asyncio.run(replay(base_url, requests, endpoint=endpoint, model=model or server.model_id,
                                                time_scale=time_scale, vocab=vocab, seed=spec.settings.seed,
                                                max_concurrency=max_concurrency, api_key=api_key, progress=progress))
    except BaseException as exc:
        if tracker is not None:  # Ctrl-C / SIGTERM: KILLED, as every interrupted run
            stopped = isinstance(exc, KeyboardInterrupt)
            tracker.fail(run_id, "interrupted" if stopped else f"{type(exc).__name__}: {exc}",
                         status="KILLED" if stopped else "FAILED")
        raise
    rows = request_rows(outcomes, time_scale)
    summary = summarize(rows, slo)
    for r in rows:
        del r["_itl"]
    errors = [r["fail_reason"] for r in rows if r["fail_reason"]]
    info = {"mode": "bench-serve", "base_url": base_url, "endpoint": endpoint, "time_scale": time_scale,
            "wall_s": time.perf_counter() - t_wall, "replay_wall_s": wall, "policy": server.tags["policy"],
            "executor": "served", "server": server.tags, "run_id": run_id}
    if errors:
        info["failures"] = f"{len(errors)} of {len(rows)} requests failed; first: {errors[0]}"
    # the run failed only if nothing was served (429s under overload are a result, not a failure)
    result = RunResult(spec=spec, summary=summary, requests=rows, microbatches=[], tracer=Tracer(0),
                       stage_tracks=[], info=info, error=info["failures"] if len(errors) == len(rows) else None)
    run_dir = Path(run_dir) if run_dir is not None else Path(spec.output.dir) / name
    write_run_dir(result, run_dir, plots=False)
    if tracker is not None:
        tracker.finish(run_id, result, run_dir, steps=False)
        result.info["mlflow_link"] = tracker.link
    return result, run_dir


def add_client_arguments(parser, required: bool) -> None:
    """The client options of `testbed bench serve`, shared by `testbed capacity --base-url`."""
    parser.add_argument("--base-url", required=required, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    parser.add_argument("--model", help="model id to send (default: the server's first /v1/models entry)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the server's clock speed (serve.time_scale)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="range of derived prompt token ids")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: unbounded)")
    parser.add_argument("--label", default="served", help="the run's name; its policy tag when the server names no policy (default: served)")


def check_client_arguments(args) -> None:
    """The numeric client options, each one `error:` line (a vocabulary of 0 ended in numpy's
    "high <= 0" traceback inside the first probe: issue 38 item 7)."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"invalid --max-concurrency {args.max_concurrency}: must be >= 1")
    if args.vocab_size < 1:
        raise ConfigError(f"invalid --vocab-size {args.vocab_size}: must be >= 1 (the range of derived prompt token ids)")


def cli_bench_serve(args, console) -> int:
    from rich.table import Table

    check_client_arguments(args)
    result, run_dir = run_bench_serve(args.base_url, list(args.overrides), endpoint=args.endpoint, model=args.model,
                                      time_scale=args.time_scale, vocab=args.vocab_size,
                                      max_concurrency=args.max_concurrency, label=args.label, console=console)
    s = result.summary
    t = Table(title=f"bench serve {args.base_url} ({result.spec.workload_name}, {s['num_requests']} requests)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("num_finished", "num_failed", "duration_s", "request_throughput", "output_throughput_tok_s",
                "throughput_tok_s", "goodput_req_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s",
                "itl_mean_s", "itl_p99_s", "e2el_mean_s", "slo_attainment"):
        v = s[key]
        t.add_row(key, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(t)
    if result.info.get("failures"):
        console.print(f"[yellow]{result.info['failures']}[/yellow]")
    if result.info.get("mlflow_link"):
        console.print(result.info["mlflow_link"], highlight=False, soft_wrap=True, markup=False)
    print(run_dir.resolve())
    return 1 if result.error else 0
