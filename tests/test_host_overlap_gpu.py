"""On a GPU a stage prepares the next micro-batch while its forward runs (engine/torch_exec/stage/worker.py):
with two stages on one GPU and micro-batches in flight together, `prepare_ahead` spans appear and
every request gets all its tokens. Marked `gpu`: skipped where CUDA is absent (tests/conftest.py);
the timer that lets the host work before waiting on a span's end is tested on CPU with fake events
(tests/test_calibration_timing.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import small_config  # noqa: E402

pytestmark = pytest.mark.gpu


def test_the_next_micro_batch_is_prepared_during_the_forward(tmp_path):
    import engine.torch_exec  # noqa: F401
    import policies  # noqa: F401
    from testbed.run.runner import prepare_experiment

    cfg = small_config("executor=torch", "executor.device=cuda", "policy=gllm", "workload.num_requests=12",
                       "workload.arrival=offline", "model=tiny-llama", "check_integrity=false", "parallel.pp=2",
                       "kv.num_blocks=2048", out_dir=tmp_path)
    prep = prepare_experiment(cfg)
    res = prep.run()
    assert res.error is None, res.error
    assert any(name == "prepare_ahead" for _, name, *_ in prep.controller.executor.tracer.spans)
    seqs = prep.controller.sequences.values()
    assert res.summary["num_finished"] == 12 and all(len(s.output_token_ids) == s.output_len for s in seqs)
