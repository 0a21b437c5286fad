"""`testbed bench sim --compare REF` (issue 51): both checkouts measured, each round with its ratios."""
from testbed.cli import main


def test_compare_runs_both_checkouts_and_prints_ratios(capsys):
    code = main(["bench", "sim", "--compare", "HEAD", "--rounds", "1", "--policies", "vllm",
                 "workload.num_requests=40", "model=llama2-13b"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "simulator side by side (reference)" in out and "vs HEAD" in out
    assert "CPU ratio" in out and "median" in out and "loop CPU s" in out


def test_compare_with_an_unknown_ref_is_one_error_line(capsys):
    code = main(["bench", "sim", "--compare", "no-such-ref-51", "--policies", "vllm"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "no-such-ref-51" in err and len(err.strip().splitlines()) == 1


def test_compare_needs_a_round(capsys):
    code = main(["bench", "sim", "--compare", "HEAD", "--rounds", "0", "--policies", "vllm"])
    assert code == 2 and "--rounds" in capsys.readouterr().err
