"""`testbed bench engine --compare`: each policy on executor=torch against Hugging Face `generate`.

    testbed bench engine --compare                          # the defaults below
    testbed bench engine --compare --policies sarathi vllm --num-requests 200 --pp 2 \
        --model tiny-llama --out runs/bench_torch.json

(Without --compare, `testbed bench engine [overrides] [--quick]` measures step times against the
floor: testbed/bench/engine_grid.py.)

(also `python -m testbed.bench.engine ...`; it lives in testbed/ because it composes run configs
and workloads, which the engine must not import.)

For each policy: one run of the controller + `TorchExecutor` over the same requests (ShareGPT,
offline: every request arrives at t=0), reporting generated tokens/s over the run window, the
per-stage bubble ratio and utilisation (from the stages' own spans), and the controller's own
cost per micro-batch: wall time inside `policy.schedule` + `Controller._commit` +
`Controller.complete` (timed by wrapping them), next to the driver's `launch` cost (metadata,
encoding, ZeroMQ sends) and the time spent waiting on stages.

The baseline is Hugging Face `generate` on the same checkpoint in this process: static batches of
`--hf-batch` requests in arrival order, left-padded, greedy, each batch running until its longest
request has its tokens (what static batching costs); throughput counts only the tokens each
request asked for. It runs with `pp * threads_per_stage` torch threads (the same cores as the
pipeline) unless `--hf-threads` says otherwise.

Prompt ids are the engine's deterministic ids (engine/torch_exec/weights/checkpoint.py): a random model
has no tokenizer, and ShareGPT here supplies the lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Before torch loads OpenMP: with active spin-waiting, 2 threads on a 2-core machine that other
# processes also use made 300 small matmuls take 1.2 s instead of 0.04 s (measured); passive
# waiting brings 2 threads back to 0.07 s. Matters for the HF baseline's threads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _timed_policy(policy_name: str, policy_params: dict, times: dict):
    """The policy, its `schedule` wrapped to add its wall time to `times`."""
    from engine.core.policy import POLICIES

    policy = POLICIES.get(policy_name).from_config(policy_params)
    inner = policy.schedule

    def timed_schedule(view):
        t = time.perf_counter()
        try:
            return inner(view)
        finally:
            times["schedule"] += time.perf_counter() - t
            times["schedule_calls"] += 1

    policy.schedule = timed_schedule
    return policy


def _timed_controller(times: dict):
    """A Controller subclass timing `_commit` and `complete` into `times`."""
    from engine.core.controller import Controller

    class TimedController(Controller):
        def _commit(self, mb):
            t = time.perf_counter()
            super()._commit(mb)
            times["commit"] += time.perf_counter() - t

        def complete(self, completion):
            t = time.perf_counter()
            out = super().complete(completion)
            times["complete"] += time.perf_counter() - t
            return out

    return TimedController


def _executor(executor: str, args, cost, policy, tracer, spec):
    import engine.torch_exec  # noqa: F401
    from engine.core.executor import EXECUTORS, ExecutorBuild
    from engine.core.policy import RuntimeFeatures
    from engine.base.settings import Link
    from engine.torch_exec.settings import TorchSettings

    if executor == "torch":
        settings = TorchSettings(threads_per_stage=args.threads_per_stage, model_cache_dir=args.model_cache_dir,
                                 stage_timeout_s=120.0)
    else:
        settings = EXECUTORS.get(executor).config_cls()
    return EXECUTORS.get(executor).factory(settings, ExecutorBuild(cost, RuntimeFeatures(), Link(1e9, 0.0), policy,
                                                                   tracer, spec.settings))


def run_policy(policy_name: str, requests, args, policy_params: dict, executor: str = "torch") -> dict:
    import policies  # noqa: F401
    from engine.core.kv import BlockManager
    from engine.core.trace import Tracer
    from testbed.config.spec import compose_spec
    from testbed.run.runner import build_cost_model

    spec = compose_spec([f"model={args.model}", f"parallel.pp={args.pp}", f"policy={policy_name}",
                         f"output.dir={args.output_dir}"])
    values = {"kv.num_blocks": args.num_blocks}  # the pool below; never measured (engine/torch_exec/shared/kv_sizing.py)
    if args.layer_split:
        values["parallel.layer_split"] = list(args.layer_split)
    spec = spec.with_values(values)
    cost = build_cost_model(spec)
    times = {"schedule": 0.0, "commit": 0.0, "complete": 0.0, "schedule_calls": 0}
    policy = _timed_policy(policy_name, policy_params, times)
    tracer = Tracer()
    ex = _executor(executor, args, cost, policy, tracer, spec)
    kv = BlockManager(args.num_blocks, args.block_size)
    from workloads.history import history_for_run

    ctrl = _timed_controller(times)(requests, policy, ex, kv, cost_model=cost, history=history_for_run)
    wall = time.perf_counter()
    try:
        ctrl.run()
    finally:
        ex.shutdown()
    wall = time.perf_counter() - wall
    out = _figures(ctrl, ex, tracer, requests, args, times)
    out.update(policy=policy_name if executor == "torch" else f"{policy_name} (executor={executor})",
               params=policy_params, layers=list(cost.layers), wall_s=wall)
    return out


def _figures(ctrl, ex, tracer, requests, args, times: dict) -> dict:
    from engine.core.metrics import SLO, summarize

    s = summarize(ctrl, SLO(), [f"stage{s}" for s in range(args.pp)])
    n_mb = max(1, s["num_microbatches"])
    ctrl_s = times["schedule"] + times["commit"] + times["complete"]
    span_means = {}
    for track, name, a, b, _ in tracer.spans:
        key = f"{track}/{name.split(':')[0]}"
        tot, cnt = span_means.get(key, (0.0, 0))
        span_means[key] = (tot + (b - a), cnt + 1)
    return {
        "generated_tokens": sum(r.output_len for r in requests), "duration_s": s["duration_s"],
        "output_tok_s": s["output_throughput_tok_s"], "total_tok_s": s["throughput_tok_s"],
        "stage_bubble_ratio": s["stage_bubble_ratio"], "stage_utilization": s["stage_utilization"],
        "num_microbatches": s["num_microbatches"], "mean_tokens_per_mb": s["mean_tokens_per_microbatch"],
        "num_preemptions": s["num_preemptions"], "ttft_p50_s": s["ttft_p50_s"], "tpot_p50_s": s["tpot_p50_s"],
        "controller_us_per_mb": 1e6 * ctrl_s / n_mb,
        "schedule_us_per_mb": 1e6 * times["schedule"] / n_mb,
        "commit_us_per_mb": 1e6 * times["commit"] / n_mb,
        "complete_us_per_mb": 1e6 * times["complete"] / n_mb,
        "schedule_calls": times["schedule_calls"],
        "driver_launch_us_per_mb": 1e6 * getattr(ex, "launch_overhead_s", 0.0) / n_mb,
        "span_mean_ms": {k: round(1e3 * t / c, 3) for k, (t, c) in sorted(span_means.items())},
        "stage_info": getattr(ex, "stage_info", None),
        "num_finished": s["num_finished"],
    }


def run_hf(requests, args, path: str, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engine.torch_exec.weights.checkpoint import prompt_ids, read_arch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        vocab = read_arch(path).vocab_size
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        seed = args.prompt_seed
        t0 = time.perf_counter()
        gen = 0
        steps = 0
        with torch.inference_mode():
            for i in range(0, len(requests), args.hf_batch):
                batch = requests[i:i + args.hf_batch]
                ids = [prompt_ids(r, vocab, seed) for r in batch]
                L = max(len(x) for x in ids)
                inp = torch.zeros((len(batch), L), dtype=torch.long)
                mask = torch.zeros((len(batch), L), dtype=torch.long)
                for j, x in enumerate(ids):  # left padding
                    inp[j, L - len(x):] = torch.tensor(x)
                    mask[j, L - len(x):] = 1
                new = max(r.output_len for r in batch)
                model.generate(inp, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
                gen += sum(r.output_len for r in batch)
                steps += new
                if args.verbose:
                    print(f"  hf batch {i // args.hf_batch}: {len(batch)} requests, {new} steps, "
                          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
        dt = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old)
    return {"policy": f"hf-generate(batch={args.hf_batch}, threads={threads})", "generated_tokens": gen,
            "duration_s": dt, "output_tok_s": gen / dt, "decode_steps": steps}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The benchmark's options (on its own parser, or on `testbed bench engine`'s)."""
    ap.add_argument("--policies", nargs="+", default=None, help="default: every registered policy")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layer-split", type=int, nargs="+", default=None)
    ap.add_argument("--threads-per-stage", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--workload", default="sharegpt", help="sharegpt or synthetic")
    ap.add_argument("--max-len", type=int, default=2048, help="drop requests with prompt + output above this")
    ap.add_argument("--data-dir", default=os.environ.get("TESTBED_DATA_DIR"))
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--param", action="append", default=[], metavar="POLICY.KEY=VALUE",
                    help="policy hyperparameter, e.g. sarathi.token_budget=512 (repeatable)")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-threads", type=int, nargs="*", default=None,
                    help="torch threads for the HF baseline (default: pp * threads-per-stage); none = skip")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--controller-sim", action="store_true",
                    help="also time the controller per micro-batch with executor=sim on the same requests "
                         "(no stage processes competing for the cores)")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--output-dir", default="runs")
    ap.add_argument("--model-cache-dir", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--verbose", action="store_true")


def _policy_params(args, names: list[str]) -> dict[str, dict]:
    params: dict[str, dict] = {n: {} for n in names}
    for p in args.param:
        key, _, value = p.partition("=")
        pol, _, field = key.partition(".")
        params.setdefault(pol, {})[field] = json.loads(value) if value[:1].isdigit() or value in (
            "true", "false") else value
    return params


def _requests(args) -> list:
    from engine.core.request import Request
    from workloads.base import build_workload

    wl = {"name": args.workload, "num_requests": args.num_requests, "arrival": "offline"}
    if args.workload == "sharegpt":
        wl["max_input_len"] = args.max_len // 2
    raw = build_workload(wl, args.data_dir)
    return [Request(r.request_id, r.arrival_s, r.prompt_len, min(r.output_len, args.max_len - r.prompt_len))
            for r in raw]


def _run_policies(names: list[str], requests, args, params: dict) -> list[dict]:
    results = []
    for name in names:
        t = time.perf_counter()
        r = run_policy(name, requests, args, params.get(name, {}))
        r["load_avg"] = _load_avg()
        results.append(r)
        print(json.dumps(r), flush=True)
        print(f"# {name}: {r['output_tok_s']:.1f} generated tok/s, bubbles {[round(b, 3) for b in r['stage_bubble_ratio']]}, "
              f"controller {r['controller_us_per_mb']:.1f} us/mb ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    if args.controller_sim:
        import engine.simulator.sim  # noqa: F401

        for name in names:
            r = run_policy(name, requests, args, params.get(name, {}), executor="sim")
            results.append(r)
            print(json.dumps({k: r[k] for k in ("policy", "num_microbatches", "controller_us_per_mb",
                                                "schedule_us_per_mb", "commit_us_per_mb", "complete_us_per_mb",
                                                "mean_tokens_per_mb")}), flush=True)
    return results


def _run_baselines(requests, args, path: str) -> list[dict]:
    results = []
    hf_threads = args.hf_threads if args.hf_threads is not None else [args.pp * args.threads_per_stage]
    for th in ([] if args.skip_hf else hf_threads):
        r = run_hf(requests, args, path, th)
        r["load_avg"] = _load_avg()
        results.append(r)
        print(json.dumps(r), flush=True)
        print(f"# {r['policy']}: {r['output_tok_s']:.1f} generated tok/s", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m testbed.bench.engine", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    import engine.torch_exec  # noqa: F401
    import policies  # noqa: F401
    from engine.pricing.models import get_model
    from engine.core.policy import POLICIES
    from engine.torch_exec.weights.checkpoint import random_checkpoint

    names = args.policies or POLICIES.names()
    params = _policy_params(args, names)
    args.model_cache_dir = args.model_cache_dir or os.path.join(args.output_dir, "models")
    path = random_checkpoint(get_model(args.model), 0, args.model_cache_dir)
    requests = _requests(args)
    info = {"model": args.model, "checkpoint": path, "pp": args.pp, "threads_per_stage": args.threads_per_stage,
            "num_requests": len(requests), "prompt_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.output_len for r in requests), "kv_blocks": args.num_blocks,
            "block_size": args.block_size, "cpu_count": os.cpu_count(), "load_avg_start": _load_avg()}
    print(json.dumps(info), flush=True)
    results = _run_policies(names, requests, args, params) + _run_baselines(requests, args, path)
    out = {"info": info, "results": results}
    if args.out:  # checked before the measurement; a late failure keeps the figures elsewhere
        from testbed.run.out_checks import write_or_keep

        write_or_keep(Path(args.out), json.dumps(out, indent=1), "the figures")
    return out


if __name__ == "__main__":
    main()
