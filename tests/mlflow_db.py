"""An empty MLflow SQLite tracking database for a test, copied from one made once per pytest
process: creating one runs MLflow's schema migrations (~7 s on the 2-core machines,
measured), copying the result takes milliseconds."""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

_TEMPLATE: Path | None = None


def fresh_mlflow_db(out_dir: Path) -> str:
    """Put an empty, migrated `mlflow.db` into `out_dir` (the runs' `output.dir`); return its URI."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from mlflow.tracking import MlflowClient

        folder = Path(tempfile.mkdtemp(prefix="testbed-mlflow-template-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / "mlflow.db"
        MlflowClient(f"sqlite:///{path}").search_experiments()  # creates and migrates
        _TEMPLATE = path
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "mlflow.db"
    shutil.copyfile(_TEMPLATE, target)
    return f"sqlite:///{target.resolve()}"
