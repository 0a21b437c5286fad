"""MLflow's telemetry is off in every process the project starts (issue 48 item 6): its thread once
removed an environment variable while another thread read them (a KeyError traceback, a run left
RUNNING). Outside pytest, MLflow turns it off only in CI or when asked; pytest's own
PYTEST_CURRENT_TEST turns it off too, so the processes here run without it."""
from __future__ import annotations

import os
import subprocess
import sys

from signal_helpers import REPO

CI_MARKERS = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS",
              "BUILDKITE", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY")


def test_mlflow_telemetry_is_off_in_the_projects_processes():
    """A process that imports the project, and a child it starts, see telemetry off."""
    env = {k: v for k, v in os.environ.items() if k not in CI_MARKERS}
    env["PYTHONPATH"] = str(REPO)
    code = ("import subprocess, sys, testbed.cli\n"
            "from mlflow.telemetry.utils import is_telemetry_disabled\n"
            "child = subprocess.run([sys.executable, '-c', 'from mlflow.telemetry.utils import is_telemetry_disabled;"
            "print(is_telemetry_disabled())'], capture_output=True, text=True).stdout.strip()\n"
            "print(is_telemetry_disabled(), child)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr[-2000:]
