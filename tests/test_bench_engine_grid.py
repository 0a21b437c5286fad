"""`testbed bench engine --quick` on CPU with tiny-llama: the grid's tables have their structure and
every ratio to the floor is a finite positive number (figures are printed, never asserted)."""
from __future__ import annotations

import argparse
import io
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")


def _args(tmp_path, *overrides: str, bandwidth: bool = False) -> argparse.Namespace:
    from testbed.bench.engine_grid import add_grid_arguments

    ap = argparse.ArgumentParser()
    add_grid_arguments(ap)
    argv = [*overrides, f"output.dir={tmp_path}", "--quick", "--json", str(tmp_path / "grid.json")]
    return ap.parse_args(argv + (["--attention-bandwidth"] if bandwidth else []))


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
def test_quick_grid_on_cpu_prints_floor_ratios(tmp_path):
    from rich.console import Console

    from testbed.bench.engine_grid import QUICK, grid_points, run_grid

    console = Console(file=io.StringIO(), width=200)
    out = run_grid(_args(tmp_path, "model=tiny-llama", "parallel.pp=2", bandwidth=True), console)
    text = console.file.getvalue()
    assert "x floor" in text and "decode step" in text and "prefill" in text and "end to end" in text
    assert out["info"]["pp"] == 2 and out["info"]["device"] == "cpu" and out["info"]["dtype"] == "float32"
    rows = out["rows"]
    assert [(r["kind"], r["batch"], r["tokens"], r["context"]) for r in rows] == \
        [(p.kind, p.batch, p.tokens, p.context) for p in grid_points(QUICK)]
    for r in rows:
        for key in ("step_s", "forward_s", "linear_floor_s", "attention_floor_s", "x_floor"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["step_s"] >= r["forward_s"]  # the step includes every stage's forward
    e2e = out["end_to_end"]
    assert e2e["num_finished"] == e2e["num_requests"] == 6
    assert e2e["total_tok_s"] > e2e["output_tok_s"] > 0 and len(e2e["stage_bubble_ratio"]) == 2
    bw = out["attention_bandwidth"]
    assert bw["copy_Bps"] > 0 and (bw["note"] or bw["rows"])  # on CPU: a note instead of the kernel row
    assert (tmp_path / "grid.json").exists()


def test_the_cli_routes_overrides_to_the_grid_and_compare_to_the_policies():
    from testbed.cli import build_parser

    args = build_parser().parse_args(["bench", "engine", "model=tiny-llama", "parallel.pp=2", "--quick"])
    assert args.overrides == ["model=tiny-llama", "parallel.pp=2"] and args.quick and not args.compare
    args = build_parser().parse_args(["bench", "engine", "--compare", "--policies", "sarathi", "--pp", "1"])
    assert args.compare and args.policies == ["sarathi"] and args.pp == 1


@pytest.mark.parametrize("override, words", [("executor=sim", "invalid executor=sim"),
                                             ("executor.profile_tokens=0", "executor.profile_tokens")])
def test_bad_input_is_one_error_line(override, words, capsys, tmp_path):
    from testbed.cli import main

    assert main(["bench", "engine", override, f"output.dir={tmp_path}", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err


def test_workload_sharegpt_composes_and_synthetic_keeps_its_lengths(tmp_path):
    from testbed.bench.engine_grid import QUICK, _config

    spec = _config(["model=tiny-llama", "workload=sharegpt", f"output.dir={tmp_path}"], True, QUICK)
    assert spec.workload.name == "sharegpt" and spec.workload.num_requests == 6
    spec = _config(["model=tiny-llama", f"output.dir={tmp_path}"], True, QUICK)
    assert spec.workload.name == "synthetic" and spec.workload.input_mean == 48


def test_steady_decodes_reuse_their_tables_and_launch_without_blocks():
    from engine.core.kv import BlockManager
    from engine.torch_exec.wire.tables import LaunchRows
    from testbed.bench.engine_grid import SteadyBatches

    kv = BlockManager(256, 16)
    batches = SteadyBatches(kv)
    seqs = batches.decodes(4, 40)  # 39 tokens held: 3 blocks each; the steps cross no block boundary
    rows = LaunchRows(vocab=1000, prompt_seed=0)
    sent = []
    for step in range(5):
        mb = batches.decode_step()
        _, decodes, released = rows.rows(mb, kv.block_table, kv.holds)
        sent.append(sum(len(d.blocks) for d in decodes))
        assert [d.position for d in decodes] == [39 + step] * 4 and not released
        batches.advance([7] * 4)
    assert sent == [12, 0, 0, 0, 0]  # whole tables once, then nothing: the sequences keep their blocks
    assert all(s.output_token_ids == [7] * 5 for s in seqs)
    batches.release()
    assert kv.num_free == 256


def test_kernel_tables_on_cpu_name_the_top_ops_of_each_kind(tmp_path):
    from rich.console import Console

    from testbed.bench.engine_grid import QUICK, _config
    from testbed.bench.engine_kernels import kernel_tables, print_kernels

    spec = _config(["model=tiny-llama", f"output.dir={tmp_path}"], True, QUICK)
    out = kernel_tables(spec, quick=True, repeats=1, top=5)
    assert out["device"] == "cpu" and [k["kind"] for k in out["kinds"]] == ["decode", "mixed", "prefill"]
    for k in out["kinds"]:
        assert 0 < len(k["rows"]) <= 5 and k["forward_s"] > 0 and k["host_ms"] > 0
        assert "aten::mm" in [r["name"] for r in k["rows"]]  # the linear layers lead on CPU
        assert 0 < sum(r["share"] for r in k["rows"]) <= 1.0 + 1e-9
    console = Console(file=io.StringIO(), width=200)
    print_kernels(out, console)
    assert "mixed 64 prefill + 8 decodes x 128" in console.file.getvalue()
