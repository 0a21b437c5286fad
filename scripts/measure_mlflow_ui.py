#!/usr/bin/env python3
"""CPU and wall time of README step 3 (issue 49 item 2): `mlflow ui` as the tour starts it, until it
answers, then what opening the printed link asks of it (the page, its static bundle, and for every
experiment the calls the runs view makes), summed over the server's process tree (psutil). The
browser's own CPU is not counted.

    python scripts/measure_mlflow_ui.py runs/mlflow.db [PORT]
    # 2026-11-27, after steps 1-2: up in 49 s with 6.0 s of CPU (2 processes), the link 0.3 s, load 17-21
"""
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

store, port = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "5000")
if not Path(store).is_file():
    print(f"error: no MLflow store at {store!r}; valid: the mlflow.db a tour step wrote (runs/mlflow.db)", file=sys.stderr)
    sys.exit(2)
mlflow = str(Path(sys.executable).parent / "mlflow")
env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
t0 = time.monotonic()
proc = subprocess.Popen([mlflow, "ui", "--workers", "1", "--port", port,
                         "--backend-store-uri", f"sqlite:///{store}"], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
root = psutil.Process(proc.pid)
seen: dict[int, float] = {}

def cpu() -> float:
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            seen[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return sum(seen.values())

base = f"http://127.0.0.1:{port}"
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=1).read()
        break
    except OSError:
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            proc.kill()
            print(f"error: mlflow ui did not answer on port {port} (exit {proc.poll()})", file=sys.stderr)
            sys.exit(1)
        cpu()
        time.sleep(0.2)
up_s, up_cpu, procs = time.monotonic() - t0, cpu(), len(root.children(recursive=True)) + 1

def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60).read()

t1 = time.monotonic()
html = urllib.request.urlopen(base + "/", timeout=60).read().decode()
assets = re.findall(r'(?:src|href)="\.?/?(static-files/[^"]+)"', html)
for asset in assets:
    urllib.request.urlopen(f"{base}/{asset}", timeout=60).read()
exps = json.loads(post("/ajax-api/2.0/mlflow/experiments/search", {"max_results": 1000}))["experiments"]
for e in exps:
    urllib.request.urlopen(f"{base}/ajax-api/2.0/mlflow/experiments/get?experiment_id={e['experiment_id']}", timeout=60).read()
    post("/ajax-api/2.0/mlflow/runs/search", {"experiment_ids": [e["experiment_id"]], "max_results": 100,
                                              "run_view_type": "ACTIVE_ONLY", "order_by": ["attributes.start_time DESC"]})
open_s, open_cpu = time.monotonic() - t1, cpu() - up_cpu
load = os.getloadavg()[0]
proc.terminate(); proc.wait(30)
print(json.dumps({"up_s": round(up_s, 1), "up_cpu_s": round(up_cpu, 1), "processes": procs,
                  "open_s": round(open_s, 1), "open_cpu_s": round(open_cpu, 1), "experiments": len(exps), "assets": len(assets), "load": load}))
