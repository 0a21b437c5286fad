#!/usr/bin/env bash
# Byte-identity check between two checkouts (a refactor must not change a simulated result):
# 12 `testbed run` configurations (six policies, three workloads, five GPUs, tp=2, a pinned
# micro-batch count, an emulated link) and every `testbed reproduce <study> --quick`; compares
# the sha256 of each run's summary.json, requests.csv and microbatches.csv (the exit status), and
# reports which of the 12 config.yaml records differ (a new config key changes them, not a result).
# Both checkouts run with this checkout's .venv (PYTHONPATH picks the code).
#   scripts/byte_identity.sh ../old-checkout .        # e.g. git worktree add ../old-checkout <rev>
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
export TESTBED_DATA_DIR="${TESTBED_DATA_DIR:-$(cd "$here/.." && pwd)/shared/data}"
configs=(
 "policy=gllm workload=azure workload.num_requests=400"
 "policy=sarathi workload=azure workload.num_requests=400"
 "policy=vllm workload=sharegpt workload.arrival=offline workload.num_requests=300"
 "policy=tdpipe workload=sharegpt workload.arrival=offline workload.num_requests=300"
 "policy=sipipe workload=synthetic workload.num_requests=300"
 "policy=molink workload=synthetic workload.num_requests=300 link.latency=30ms link.bandwidth=100Mbps"
 "policy=gllm workload=synthetic workload.num_requests=300 hardware=a100-80g model=llama-3.1-70b"
 "policy=tdpipe workload=azure workload.num_requests=300 hardware=h100-80g"
 "policy=sarathi workload=synthetic workload.num_requests=300 parallel.tp=2 parallel.pp=2"
 "policy=vllm workload=azure workload.num_requests=300 parallel.num_microbatches=2"
 "policy=sipipe workload=azure workload.num_requests=300 hardware=a40-48g"
 "policy=molink workload=sharegpt workload.num_requests=300 seed=3"
)
studies=$(cd "$here" && "$py" -m testbed.cli reproduce --list | awk '{print $1}')

hashes() {  # hashes CHECKOUT OUTFILE
  local repo work i=0
  repo="$(cd "$1" && pwd)"; work="$(mktemp -d)"; : > "$2"
  for c in "${configs[@]}"; do
    i=$((i + 1))
    # a simulated run keeps microbatches.csv only when asked (a checkout that knows the switch)
    mb=""; grep -q "microbatches: bool" "$repo/engine/base/settings.py" && mb="output.microbatches=true"
    (cd "$repo" && PYTHONPATH="$repo" "$py" -m testbed.cli run $c $mb output.dir="$work" output.plots=false \
      output.progress=false output.mlflow=false output.run_name=c$i > /dev/null 2> "$work/c$i.err") \
      || echo "c$i FAILED: $(tail -1 "$work/c$i.err")" >> "$2"
    for f in summary.json requests.csv microbatches.csv config.yaml; do
      [ -f "$work/c$i/$f" ] && echo "$(sed "s#$work#WORK#g" "$work/c$i/$f" | sha256sum | cut -c1-16) c$i/$f" >> "$2"
    done
  done
  for s in $studies; do
    (cd "$repo" && PYTHONPATH="$repo" "$py" -m testbed.cli reproduce "$s" --quick output.dir="$work" \
      output.mlflow=false > /dev/null 2> "$work/$s.err") || echo "$s FAILED: $(tail -1 "$work/$s.err")" >> "$2"
    find "$work/reproduce/$s-quick" \( -name summary.json -o -name requests.csv -o -name microbatches.csv \) \
      2> /dev/null | sort | while read -r f; do echo "$(sha256sum < "$f" | cut -c1-16) ${f#"$work"/}" >> "$2"; done
  done
  rm -rf "$work"
}

old="$(mktemp)"; new="$(mktemp)"
hashes "$1" "$old"; hashes "$2" "$new"
records=$(diff <(grep config.yaml "$old") <(grep config.yaml "$new") | grep -c '^>')
echo "config.yaml records that differ: $records of ${#configs[@]}"
if diff <(grep -v config.yaml "$old") <(grep -v config.yaml "$new"); then
  echo "results identical: $(grep -vc config.yaml "$new") files"
else
  echo "results DIFFERENT (lines above: < $1, > $2)"; exit 1
fi
