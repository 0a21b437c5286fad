"""Stage processes keep the memory they free (engine/torch_exec/driver/stage_processes.py MALLOC_ENV):
a child started with the stage environment re-uses a freed 64 MB buffer instead of faulting it in
again page by page (the cause of the CPU decode episodes, docs/measurements/decode-episodes-2026-11-28b.md)."""
import json
import os
import subprocess
import sys

from engine.torch_exec.driver.stage_processes import MALLOC_ENV, STAGE_ENV

CHILD = """
import json, resource
n = 64 << 20
x = b"\\x01" * n; del x  # first use: faults the memory in whatever the settings
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    x = b"\\x01" * n; del x
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
"""


def _faults(extra: dict) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_stage_env_carries_the_malloc_settings():
    assert all(STAGE_ENV[k] == v for k, v in MALLOC_ENV.items())


def test_freed_buffers_are_reused_not_faulted_again():
    default, stage = _faults({}), _faults(MALLOC_ENV)
    pages = 5 * (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert default > pages // 2  # glibc's default maps and unmaps a 64 MB buffer each time
    assert stage < pages // 20  # the stage's settings keep it
