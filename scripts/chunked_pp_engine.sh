#!/usr/bin/env bash
# chunked_pp's direction on the real engine (CPU, tiny-llama, P=2) beside the simulator on the same
# machine's profile: dynamic chunks, fixed chunks and Sarathi, 12 prompts of 1,984 tokens at 0.5 req/s,
# first chunk / token budget 1,024. Engine runs under `chrt -f 10` (root) so other processes'
# load does not distort them; the load before and after each run is printed (docs/policies-specialised.md#chunked_pp).
#   scripts/chunked_pp_engine.sh [OUT_DIR]     # default /tmp/chunked-pp-engine
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-/tmp/chunked-pp-engine}"
py="${PYTHON:-$here/.venv/bin/python}"
export TESTBED_PROFILE_DIR="$out/profiles" TESTBED_ALLOW_DOWNLOAD=0
rt=(); [ "$(id -u)" = 0 ] && rt=(chrt -f 10)
mkdir -p "$out"
cd "$here" || exit 2
"${rt[@]}" "$py" -m testbed.cli profile executor=torch model=tiny-llama parallel.pp=2 --grid default \
  --name cpu-tiny-llama-pp2 --out "$TESTBED_PROFILE_DIR" executor.model_cache_dir="$out/models" > "$out/profile.log" 2>&1 \
  || { echo "profile failed: $(tail -1 "$out/profile.log")"; exit 1; }
common=(model=tiny-llama parallel.pp=2 hardware=cpu-tiny-llama-pp2 workload=synthetic workload.input_mean=1984
        workload.output_mean=8 workload.num_requests=12 workload.rate=0.5 kv.num_blocks=2048 kv.block_size=16
        output.mlflow=false output.plots=false output.dir="$out/runs")
systems=("dynamic|policy=chunked_pp policy.first_chunk=1024 policy.min_chunk=64 policy.align=16"
         "fixed|policy=chunked_pp policy.chunking=fixed policy.first_chunk=1024"
         "sarathi|policy=sarathi policy.token_budget=1024")
echo "| executor | system | mean TTFT (s) | p99 TTFT (s) | load before -> after |"
echo "|---|---|---|---|---|"
for ex in torch sim; do
  for s in "${systems[@]}"; do
    name="${s%%|*}"; read -r -a ov <<< "${s#*|}"
    extra=(); [ "$ex" = torch ] && extra=(executor.model_cache_dir="$out/models")
    before="$(cut -d' ' -f1 /proc/loadavg)"
    "${rt[@]}" "$py" -m testbed.cli run executor=$ex "${common[@]}" "${ov[@]}" "${extra[@]}" \
      output.run_name="$ex-$name" > "$out/$ex-$name.log" 2>&1 || { echo "| $ex | $name | failed | | |"; continue; }
    "$py" - "$out/runs/$ex-$name/summary.json" "$ex" "$name" "$before" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {sys.argv[3]} | {s['ttft_mean_s']:.3f} | {s['ttft_p99_s']:.3f} | {sys.argv[4]} -> {sys.argv[5]} |")
PY
  done
done
