#!/bin/bash
# Re-measure this project's torch engine on one GPU: what `testbed calibrate runs` and `testbed
# validate --runs` need (docs/calibrate-runs.md), in about 5 minutes on an H100.
# Runs from the project root on the GPU machine:   OUT=/some/dir bash scripts/engine_runs_gpu.sh
# (its steps were run on an H100 on 2026-11-26 as separate commands; DEVICE=cpu MODEL=tiny-llama checks the plumbing)
# Writes $OUT/log.txt and $OUT/h100-engine.tgz: a folder laid out as the data directory's
# h100-engine-<date>/ (runs/<name>/ with trace.json, microbatches.csv, requests.csv, config.yaml,
# summary.json; the `testbed profile` serving table; the `bench engine` JSON; the gpu tests' output). Each step has its own
# time limit and the whole stays inside BUDGET seconds. Wheels in .gpu/whl (pyzmq, hydra-core,
# omegaconf, antlr4 for a machine without network) are installed first when present.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL=${MODEL:-qwen2.5-7b}; DEVICE=${DEVICE:-cuda}; BUDGET=${BUDGET:-480}  # DEVICE=cpu: a plumbing check; OUT=${OUT:?set OUT to the folder to bring back}
T=${TMPDIR:-/tmp}/engine_runs; rm -rf "$T"; mkdir -p "$T/res/runs"; START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
cap() { local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
spent() { [ "$(left)" -lt 10 ] && echo "    (skipped: the budget is spent)"; }  # timeout 0 would mean no limit
pack() { tar czf "$OUT/h100-engine.tgz" -C "$T" res 2>/dev/null; }
exec > >(tee "$OUT/log.txt") 2>&1
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$T/site" .gpu/whl/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH="$T/site:$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
git log --oneline -1 2>/dev/null
TB="python3 -m testbed.cli"
EX="executor=torch executor.device=$DEVICE model=$MODEL parallel.pp=1"
SG="workload=sharegpt workload.arrival=offline workload.num_requests=200 workload.max_total_len=2048 seed=0"
AZ="workload=azure workload.rate=8 workload.num_requests=300 seed=0"
COMMON="output.mlflow=false output.plots=false output.progress=false output.dir=$T/runs output.trace=full"
run() {  # run <name> <seconds> <overrides...>: one traced run, its files kept
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(left) s left)"; spent && return
  timeout -k 5 "$(cap "$limit")" $TB run $EX "$@" $COMMON output.run_name="$name" 2>&1 | tail -20
  mkdir -p "$T/res/runs/$name"
  (cd "$T/runs/$name" 2>/dev/null && cp summary.json requests.csv microbatches.csv config.yaml trace.json "$T/res/runs/$name/")
  pack
}
run sharegpt200-offline-gllm-traced 150 policy=gllm $SG   # the fit run
run sharegpt200-offline-sarathi 100 policy=sarathi $SG    # held out
run azure-rate8-gllm 130 policy=gllm $AZ                  # held out
run sharegpt200-offline-gllm-r2 90 policy=gllm $SG        # repeats: the engine's own spread
run sharegpt200-offline-sarathi-r2 90 policy=sarathi $SG
echo "=== profile table ($(left) s left)"; spent ||
timeout -k 5 "$(cap 75)" $TB profile $EX output.dir="$T/runs" --grid serving --repeats 3 \
  --name "profile_${MODEL}_pp1_serving" --out "$T/res" 2>&1 | tail -12
pack
echo "=== bench engine ($(left) s left)"; spent ||
timeout -k 5 "$(cap 200)" $TB bench engine model="$MODEL" executor.device=$DEVICE parallel.pp=1 policy=gllm \
  workload.num_requests=200 seed=0 --json "$T/res/bench_engine_${MODEL}_pp1.json" 2>&1 | tail -40
pack
echo "=== gpu tests ($(left) s left)"; spent ||   # the files holding gpu tests only: the others import MLflow/Optuna
timeout -k 5 "$(cap 150)" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --tb=short \
  $(grep -l "mark.gpu" tests/test_*.py) 2>&1 | grep -v "CUDAGraph.cpp" | tee "$T/res/gpu_tests.txt" | tail -40
pack
echo "=== done in $((SECONDS - START)) s"
