"""One measured simulation, run as `python -c <this file's text> <overrides as JSON>` in the
checkout being measured (cwd and PYTHONPATH: that checkout), so that `testbed bench sim
--compare REF` measures an older commit with the same code: it imports only what every commit
since the runner's split has (`compose_spec`, `merge`, `prepare_experiment`).

Prints one JSON line: the loop's wall time (`simulate_s`, the runner's own figure), its CPU time
(`loop_cpu_s`: process time around the controller's run, wrapped on this instance), the whole
child's peak RSS and the headline metrics. Nothing here may import from the measuring checkout.
"""
import json
import resource
import sys
import time


def main(overrides: list[str]) -> dict:
    from testbed.config.overrides import merge
    from testbed.config.spec import compose_spec
    from testbed.run.runner import prepare_experiment

    spec = compose_spec(merge(overrides, ["output.mlflow=false", "output.progress=false"]))
    prepared = prepare_experiment(spec)
    ctrl = prepared.controller
    run, cpu = ctrl.run, []

    def timed_run() -> None:
        t0 = time.process_time()
        try:
            run()
        finally:
            cpu.append(time.process_time() - t0)

    ctrl.run = timed_run
    result = prepared.run()
    s = result.summary
    return {"overrides": overrides, "simulate_s": result.info.get("simulation_s", result.info.get("simulate_s")), "loop_cpu_s": cpu[0] if cpu else float("nan"),
            "build_s": result.info["build_s"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "num_microbatches": s["num_microbatches"],
            "microbatches_per_wall_s": result.info["microbatches_per_wall_s"],
            "throughput_tok_s": s["throughput_tok_s"], "bubble_ratio": s["bubble_ratio"],
            "ttft_mean_s": s["ttft_mean_s"], "tpot_mean_s": s["tpot_mean_s"], "num_preemptions": s["num_preemptions"]}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
