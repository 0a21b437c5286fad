"""Shared fixtures: the data directory (../shared/data unless TESTBED_DATA_DIR says otherwise),
no downloads ever, and small configs."""
from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import pytest

pytest_plugins = ["cpu_report", "progress"]  # --cpu-top=N (tests/cpu_report.py); count lines (tests/progress.py)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("TESTBED_DATA_DIR", str(DEFAULT_DATA))
os.environ["TESTBED_ALLOW_DOWNLOAD"] = "0"
# Without a GPU the Triton kernels (engine/torch_exec/kernels/paged_attention.py) run under Triton's
# interpreter, which must be chosen before triton is first imported (transformers imports it)
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Full garbage collections in this process, one every 10 collections of the middle generation by
# default, each walk the ~800,000 objects torch, MLflow, Ray and Optuna leave here (a `testbed run`
# process holds ~80,000): 29 of them took 5.5 of 60 s of CPU over the conformance, reproduce and
# baseline-policy files. Every 100th: 6 took 2.4 s (`--cpu-top` prints the GC's share). Cyclic
# garbage is still collected, later; the processes the tests start keep Python's defaults.
gc.set_threshold(*gc.get_threshold()[:2], 100)


def pytest_collection_modifyitems(config, items) -> None:
    """`gpu`-marked tests are skipped where CUDA is absent (CI never needs a GPU)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """One folder of random-weight checkpoints for the session (engine/torch_exec/weights/checkpoint.py:
    `random_checkpoint` builds a model into it once, then returns it): nine modules built their
    own copies of the same two tiny models, ~0.4 s of CPU each. Tests that change a checkpoint
    copy it first."""
    return str(tmp_path_factory.mktemp("models"))


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class WritesUnder:
    """The paths under `folder` that this process opened for writing, created, renamed or
    connected SQLite to, seen by an audit hook (PEP 578: every `open`, `os.open`, `os.mkdir`,
    `os.rename`/`os.replace` and `sqlite3.connect` raises its event). It judges only what the
    test process did: a listing before and after also counted the user's own `testbed compare`
    running in the same checkout meanwhile, and failed the suite for it (issue 40 item 4)."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder.resolve())
        self.seen: list[str] = []
        self.active = True

    EVENTS = frozenset({"open", "os.mkdir", "sqlite3.connect", "os.rename", "os.replace"})

    def __call__(self, event: str, args: tuple) -> None:
        if event not in self.EVENTS or not self.active:  # first: the hook sees every audited event
            return
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (mode is None and isinstance(flags, int) and bool(flags & WRITE_FLAGS))
        elif event in ("os.mkdir", "sqlite3.connect"):
            path, writes = args[0], True
        elif event in ("os.rename", "os.replace"):
            path, writes = args[1], True
        if writes and isinstance(path, (str, bytes, os.PathLike)):
            try:
                full = os.path.abspath(os.fsdecode(path))
            except (TypeError, ValueError):
                return
            if full == self.folder or full.startswith(self.folder + os.sep):
                self.seen.append(full)


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_the_tests():
    """A suite started in the background (`./tb test &` from a script) inherits SIGINT ignored,
    and so does every command a test starts: Python then never raises KeyboardInterrupt, and the
    Ctrl-C tests saw runs that would not stop (and `_thread.interrupt_main` does nothing). A
    Python handler here is reset to the default at each child's exec, as in a terminal."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory):
    """Tests run from a scratch folder, so that every default relative path (`output.dir=runs`,
    runs/profiles, runs/predictors, the random-weight model cache under output.dir) lands there
    and never in the checkout's runs/, which belongs to the user; checked at the end, for what
    this process wrote there (`WritesUnder`; the commands the tests start run in the scratch
    folder too, inheriting it)."""
    import sys

    writes = WritesUnder(REPO / "runs")
    sys.addaudithook(writes)  # hooks cannot be removed: `active` turns it off
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)
    writes.active = False
    added = sorted({os.path.relpath(p, writes.folder) for p in writes.seen})
    assert not added, f"tests wrote into the checkout's runs/: {', '.join(added[:10])}"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = Path(os.environ["TESTBED_DATA_DIR"])
    if not (path / "azure").is_dir():
        pytest.fail(f"workload data not found at {path}: set TESTBED_DATA_DIR to a copy of ../shared/data")
    return path


def small_config(*overrides: str, out_dir: Path | None = None):
    """The RunSpec of a fast simulated run (synthetic workload, no MLflow, no plots), checking the
    KV and scheduler invariants at every launch and completion. Its pool is 4,096 blocks, not the
    A100-80GB's 9,564 (21,065 at P=4) for Llama2-13B: the 200 requests peak at ~800, and the
    invariant check walks the whole pool each time (the tests using this config took 251 s of
    CPU with the GPU's pool, 226 s with this one). Tests about capacity set their own."""
    from testbed.config.spec import compose_spec
    from testbed.config.overrides import merge

    base = ["workload=synthetic", "workload.num_requests=200", "hardware=a100-80g", "model=llama2-13b",
            "parallel.pp=2", "output.mlflow=false", "output.plots=false", "output.progress=false",
            "check_integrity=true", "kv.num_blocks=4096"]
    if out_dir is not None:
        base.append(f"output.dir={out_dir}")
    return compose_spec(merge(base, overrides))



# session-scoped PostgreSQL and mlflow servers for the `services` tests (started only when used)
from services import mlflow_server, postgres  # noqa: E402,F401
