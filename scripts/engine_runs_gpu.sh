#!/bin/bash
# Issue 47's device check in one call of at most BUDGET seconds (default 540), by PLAN: `g1` (set G1 as it ran
# on 2026-11-28: the profile table, P=1 ShareGPT runs, the gpu tests, the bench, the samplers, P=2, Azure) or
# `g2` (default: the bench and the gpu tests first, then P=1 fit runs of gllm at every workload and of SiPipe,
# validation runs, every policy at ShareGPT and Azure 8, then P=2). Written for
# measurements/gpu-<device>-<model>-<date>/: the split is declared there (manifest + test-set md) BEFORE this
# runs; the run names below are the manifest's.
#   OUT=/some/dir bash scripts/engine_runs_gpu.sh          (on the GPU machine, from the project root)
#   (from a checkout slimmed for the call: `bash scripts/device_tree.sh slim` here first, `restore` after; the copy's
#   64 MiB limit, docs/calibrate-runs.md#re-measuring)
#   DEVICE=cpu MODEL=tiny-llama GRID=quick BENCH_FLAGS=--quick OUT=/tmp/o bash scripts/engine_runs_gpu.sh  (plumbing, CPU)
#   DRY=1 OUT=/tmp/o bash scripts/engine_runs_gpu.sh   (names every run and phase in order, runs nothing: the names
#   scripts/declare_gpu_set.py writes into the manifest, checked by tests/test_declare_gpu_set.py)
# Brings back (at most 8 files): log.txt, gpu_tests.txt, bench_engine.json, profile.tar.xz (the table and its
# fit), gpu_sampler.json, cpu_sampler.json, runs.tar.xz (run folders pp<P>-<workload>-<policy>-r<k>, with
# trace.json, run_info.json: host probe, each stage's load / set-up / CUDA graph capture time and memory).
# Each step is capped; a phase never eats the next one's reserve; what the budget does not reach is
# logged as skipped. Wheels in .gpu/whl (pyzmq, hydra-core, omegaconf, antlr4) are installed first when
# present (the GPU machine has no network and lacks them; it lacks MLflow and Optuna too).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL=${MODEL:-qwen2.5-7b}; DEVICE=${DEVICE:-cuda}; BUDGET=${BUDGET:-540}; OUT=${OUT:?set OUT to the folder to bring back}
GRID=${GRID:-serving}; LO=${LO:-8}; HI=${HI:-16}   # Azure req/s (the 1a5c8d9 engine served 8 req/s x 300 on an H100)
POLICIES=${POLICIES:-"gllm sarathi vllm molink sipipe tdpipe"}
case ${PLAN:=g2} in g1|g2) ;; *) echo "error: PLAN=$PLAN is not a plan; valid choices: g1, g2"; exit 2 ;; esac
T=${TMPDIR:-/tmp}/engine_runs; rm -rf "$T"; mkdir -p "$T/runs" "$T/profile" "$OUT"; START=$SECONDS
left() { echo $(( BUDGET - (SECONDS - START) )); }
cap() { local l=$(( $(left) - ${2:-0} )); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }  # cap <s> [reserve]
spent() { [ "$(left)" -lt "$(( ${1:-10} + ${2:-0} ))" ] && echo "    (skipped: the budget is spent)"; }
# the run folders' files only (never output.dir/models: a random checkpoint, 15 GB for a 7B model)
# (Python's tarfile: the GPU machine's image may lack the xz program)
txz() { python3 -c "import sys, tarfile, glob
with tarfile.open(sys.argv[1], 'w:xz', preset=1) as t:
    [t.add(p, filter=lambda i: None if i.name.endswith('.png') else i) for g in sys.argv[2:] for p in sorted(glob.glob(g))]" "$@"; }
pack() { (cd "$T" && ls -d runs/pp* >/dev/null 2>&1 && txz "$OUT/runs.tar.xz" 'runs/pp*'); }
exec > >(tee "$OUT/log.txt") 2>&1
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$T/site" .gpu/whl/*.whl 2>&1 | grep -v WARNING
  export PYTHONPATH="$T/site:$PWD"
fi
[ -d .gpu/data ] && export TESTBED_DATA_DIR=${TESTBED_DATA_DIR:-$PWD/.gpu/data}
export TESTBED_PROFILE_DIR=$T/profile
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
git log --oneline -1 2>/dev/null; echo "cores $(nproc); load $(cat /proc/loadavg)"
TB="python3 -m testbed.cli"
COMMON="executor=torch executor.device=$DEVICE model=$MODEL seed=0 output.mlflow=false output.plots=false \
output.progress=false output.dir=$T/runs output.trace=full"
SG="workload=sharegpt workload.arrival=offline workload.num_requests=100 workload.max_output_len=128"
AZ="workload=azure workload.num_requests=100 workload.max_input_len=1024 workload.max_output_len=64"
EXTRA=""  # the engine settings of every run: set once by the fallback below if the first run fails
one() {  # one <name> <seconds> <reserve> <overrides...>: a run, unless it would eat the reserve
  local name=$1 limit=$2 reserve=$3; shift 3
  [ -n "${DRY:-}" ] && { echo "RUN $name"; return; }
  echo "=== $name ($(left) s left) load $(cut -d' ' -f1-3 /proc/loadavg)"; spent 30 "$reserve" && return
  timeout -k 5 "$(cap "$limit" "$reserve")" $TB run $COMMON $EXTRA "$@" output.run_name="$name" > "$T/run.log" 2>&1
  grep -E "throughput_tok_s|ttft|tpot|error|Error|time:" "$T/run.log"
  if [ -f "$T/runs/$name/run_info.json" ]; then
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('    stages:', [{k: round(v, 2) for k, v in s.items() if k.endswith(('_s', '_mib'))} for s in d.get('stages', [])], 'probe ms', (d.get('host') or {}).get('gemm_probe_ms'))" "$T/runs/$name/run_info.json"
  fi
  [ -f "$T/runs/$name/summary.json" ] || echo "    (no summary: the run failed or was cut; its folder is kept as it is)"
  pack
}
workload() { case $1 in sharegpt) echo "$SG";; azlo) echo "$AZ workload.rate=$LO";; azhi) echo "$AZ workload.rate=$HI";; esac; }
phase_profile() {
  [ -n "${DRY:-}" ] && { echo "PHASE ${FUNCNAME[0]}"; return; }
  echo "=== profile table, P=1, grid $GRID ($(left) s left)"; spent 20 "$1" && return
  timeout -k 5 "$(cap 80 "$1")" $TB profile executor=torch executor.device=$DEVICE model=$MODEL parallel.pp=1 \
    --grid "$GRID" --repeats 3 --name "engine-$MODEL-pp1-$GRID" --out "$T/profile" 2>&1 | tail -8
  (cd "$T" && txz "$OUT/profile.tar.xz" profile)
}
first_run() {  # first_run <name> <reserve> <overrides>: a run; if it fails, a fallback for every later run
  local name=$1 reserve=$2; shift 2
  one "$name" 60 "$reserve" "$@"
  [ -n "${DRY:-}" ] && return
  for fallback in "executor.cuda_graphs=false" "executor.cuda_graphs=false executor.attention=torch"; do
    [ -f "$T/runs/$name/summary.json" ] && break  # the first run failed: its log, then a fallback for all
    tail -40 "$T/run.log"; EXTRA=$fallback; echo "    FALLBACK: every run from here on with $EXTRA"
    rm -rf "${T:?}/runs/$name"; one "$name" 60 "$reserve" "$@"
  done
}
phase_tests() {  # files holding gpu tests only (the others import MLflow/Optuna)
  [ -n "${DRY:-}" ] && { echo "PHASE ${FUNCNAME[0]}"; return; }
  echo "=== gpu tests, full output ($(left) s left)"; spent && return
  timeout -k 5 "$(cap 130)" python3 -m pytest -m gpu -p no:cacheprovider -v -rA -s --tb=long --timeout 90 \
    $(grep -l "mark.gpu" tests/test_*.py) > "$OUT/gpu_tests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.txt" | tail -60
}
phase_bench() {
  [ -n "${DRY:-}" ] && { echo "PHASE ${FUNCNAME[0]}"; return; }
  echo "=== bench engine: grid, attention bandwidth, decode / MIXED (400 + 160 x 512) / prefill forward vs floor ($(left) s left)"
  spent && return
  timeout -k 5 "$(cap 95)" $TB bench engine model="$MODEL" executor.device=$DEVICE parallel.pp=1 policy=gllm \
    workload.num_requests=64 seed=0 ${BENCH_FLAGS:---repeats 3} --attention-bandwidth --kernels --json "$OUT/bench_engine.json" 2>&1 \
    | grep -v "^USDT" | tail -40
}
phase_samplers() {
  [ -n "${DRY:-}" ] && { echo "PHASE ${FUNCNAME[0]}"; return; }
  echo "=== samplers: GPU kernels priced vs measured, CPU sampler on this host (issue 46) ($(left) s left)"
  spent || timeout -k 5 "$(cap 25)" python3 scripts/measure_gpu_sampler.py --device "$DEVICE" --hardware h100-80g \
    --repeats 10 --out "$OUT/gpu_sampler.json" 2>&1 | tail -12
  spent || timeout -k 5 "$(cap 20)" python3 scripts/measure_cpu_sampler.py --repeats 3 --out "$OUT/cpu_sampler.json" 2>&1 | tail -6
}
runs() {  # runs <P> <workload> <reserve> <policies> <repeat>
  local P=$1 wl=$2 reserve=$3 pols=$4 rep=$5 pol
  for pol in $pols; do one "pp$P-$wl-$pol-r$rep" 60 "$reserve" parallel.pp=$P policy=$pol $(workload "$wl"); done
}

case $PLAN in
g1)  # set G1, 2026-11-28 (measurements/gpu-h200-qwen2.5-7b-2026-11-28): as it ran
  R=270   # what the gpu tests (130), bench (95) and samplers (45) are sure to get
  phase_profile $R
  first_run pp1-sharegpt-gllm-r1 $R parallel.pp=1 policy=gllm $SG
  runs 1 sharegpt $R sarathi 1; runs 1 sharegpt $R "$POLICIES" 2
  phase_tests; phase_bench; phase_samplers
  runs 2 sharegpt 0 "gllm sarathi" 1; runs 2 sharegpt 0 "$POLICIES" 2
  for spec in "1 azlo" "1 azhi" "2 azlo" "2 azhi"; do runs ${spec% *} ${spec#* } 0 "$POLICIES" 2; done ;;
g2)  # the next set (declare its manifest first): the bench and tests first (the alignment fix, 7e0e141),
     # then P=1 fit runs of gllm at every workload and SiPipe (G1's fit lacked both), validation, every
     # policy's test runs at ShareGPT and Azure 8; P=2 last
  phase_bench; phase_tests
  first_run pp1-sharegpt-gllm-r1 0 parallel.pp=1 policy=gllm $SG
  runs 1 azlo 0 gllm 1; runs 1 azhi 0 gllm 1; runs 1 sharegpt 0 sipipe 1; runs 1 azlo 0 sipipe 1
  runs 1 sharegpt 0 sarathi 1; runs 1 azlo 0 vllm 1
  runs 1 sharegpt 0 "$POLICIES" 2; runs 1 azlo 0 "$POLICIES" 2
  runs 2 sharegpt 0 "gllm sipipe sarathi" 1; runs 2 sharegpt 0 "$POLICIES" 2 ;;
esac
echo "=== done in $((SECONDS - START)) s; $(ls "$T/runs" | grep -c '^pp') run folders in $OUT/runs.tar.xz"
