#!/bin/bash
# Every policy on the real engine on CPU (tiny-llama, P=1 and P=2): the runs that
# measurements/cpu-tiny-llama/ holds and measurements/cpu-tiny-llama/manifest.yaml splits into
# fit / validation / test (docs/measurements/calibrate-runs.md#every-policy-on-the-engine-and-rank-agreement-cpu-2026-11-27).
#   OUT=/some/dir bash scripts/engine_runs_cpu.sh      (about 40 minutes on 2 shared cores)
#   OUT=/some/dir REPS="4 5 6" bash scripts/engine_runs_cpu.sh   (further repeats of every run: the
#   second test set of 2026-11-27, taken with the engine of the first runs, b68a41a: see the manifest)
#   OUT=/some/dir REPS="7 8 9" SETTINGS="pp2-sharegpt pp2-azhi pp1-azhi" bash scripts/engine_runs_cpu.sh
#   (only those settings, in that order within each repeat: the third test set)
# Every engine command runs under `chrt -f 10` (SCHED_FIFO: other tenants' processes do not preempt
# the engine's; needs root or CAP_SYS_NICE, else it runs at normal priority and says so) and
# `cat /proc/loadavg` is logged before and after each. Runs are interleaved (each repeat goes
# through every workload and policy in turn) so that a drift in the machine's load does not fall
# on one policy. Same requests for every policy: the workload and seed are fixed per setting.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:?set OUT to the folder the runs go to}; mkdir -p "$OUT/runs" "$OUT/profiles"
PRIO="chrt -f 10"; $PRIO true 2>/dev/null || { echo "no real-time priority here: running at normal priority"; PRIO=""; }
TB="python3 -m testbed.cli"
POLICIES=${POLICIES:-"gllm sarathi vllm molink sipipe tdpipe"}
COMMON="executor=torch model=tiny-llama kv.num_blocks=4096 seed=0 output.mlflow=false output.plots=false \
output.progress=false output.dir=$OUT/runs output.trace=full"
SG="workload=sharegpt workload.arrival=offline workload.num_requests=100 workload.max_output_len=128"
AZ="workload=azure workload.num_requests=100 workload.max_input_len=1024 workload.max_output_len=64"
# Azure rates: about 40% and 75% of what gllm served offline-like at 50 req/s (P=1 8.0 req/s, P=2 12.9)
declare -A LO=([1]=3 [2]=5) HI=([1]=6 [2]=9)
# three repeats of every command at both depths: the engine's own spread decides ties in the rank
# agreement (P=1 was taken once first, its two repeats after the P=2 runs, on 2026-11-27)
declare -A REPEATS=([1]=${P1_REPEATS:-3} [2]=3)
log() { echo "$*" | tee -a "$OUT/log.txt"; }
one() {  # one <name> <overrides...>
  local name=$1; shift
  [ -f "$OUT/runs/$name/summary.json" ] && { log "=== $name: done before"; return; }
  log "=== $name start $(date -u +%T) load $(cat /proc/loadavg)"
  $PRIO $TB run $COMMON "$@" output.run_name="$name" > "$OUT/runs/$name.log" 2>&1
  log "=== $name rc=$? end $(date -u +%T) load $(cat /proc/loadavg)"
}
TABLE=${TABLE_PREFIX:-cpu-tiny-llama}  # the quick tables' names: <prefix>-pp<P> (cpu-tiny-llama-quiet for 2026-11-28)
for P in 1 2; do
  [ -f "$OUT/profiles/$TABLE-pp$P.csv" ] ||
  $PRIO $TB profile executor=torch model=tiny-llama parallel.pp=$P --quick --name $TABLE-pp$P \
      --out "$OUT/profiles" >> "$OUT/log.txt" 2>&1
done
run_setting() {  # run_setting <rep> <P> <wl>
  local rep=$1 P=$2 wl=$3 W
  case $wl in sharegpt) W=$SG;; azlo) W="$AZ workload.rate=${LO[$P]}";; azhi) W="$AZ workload.rate=${HI[$P]}";; esac
  for pol in $POLICIES; do
    one "pp$P-$wl-$pol-r$rep" parallel.pp=$P policy=$pol $W
  done
}
if [ -n "${SETTINGS:-}" ]; then
  for rep in ${REPS:?SETTINGS needs REPS}; do
    for st in $SETTINGS; do run_setting "$rep" "${st:2:1}" "${st#pp?-}"; done
  done
  log "=== all done $(date -u +%T)"; exit 0
fi
for rep in ${REPS:-1 2 3}; do
  for P in 1 2; do
    [ -z "${REPS:-}" ] && [ "$rep" -gt "${REPEATS[$P]}" ] && continue
    for wl in sharegpt azlo azhi; do
      case $wl in sharegpt) W=$SG;; azlo) W="$AZ workload.rate=${LO[$P]}";; azhi) W="$AZ workload.rate=${HI[$P]}";; esac
      for pol in $POLICIES; do
        one "pp$P-$wl-$pol-r$rep" parallel.pp=$P policy=$pol $W
      done
    done
  done
done
log "=== all done $(date -u +%T)"
