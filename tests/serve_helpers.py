"""`testbed serve` started by a test in its own process, as a user runs it."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.torch_exec.wire.addresses import free_port
from signal_helpers import WAIT_S


@contextlib.contextmanager
def cli_server(tmp_path, *args, stop=signal.SIGTERM):
    """`testbed serve <args>` in its own process (as a user runs it: the client here does not share its
    interpreter lock); yields (base URL, outcome), and on exit sends `stop` and fills `outcome`
    with the exit code, stderr and the run directory the server printed. The waits are bounded by
    WAIT_S: at load ~30 on a 2-core CI machine the start alone took over the 120 s once allowed."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "serve", *args, f"serve.port={port}",
                             f"output.dir={tmp_path}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outcome = {"pid": proc.pid}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT_S
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"no /health answer in {WAIT_S} s"
            time.sleep(0.2)
        yield url, outcome
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=WAIT_S)
        outcome.update(code=proc.returncode, err=err, run_dir=Path(out.strip().splitlines()[-1]))
    finally:
        if proc.poll() is None:
            proc.kill()


