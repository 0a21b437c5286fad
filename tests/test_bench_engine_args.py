"""`testbed bench engine`'s options checked before any measurement (issue 48 items 3, 4): each case
was a traceback (`--repeats -3`), a silent accept (`--repeats 0`, the `--compare`-only options without
it), an ignored option (`--kernels --compare`) or a traceback after the measurement (`--json`)."""
from __future__ import annotations

import pytest

from testbed.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["--repeats", "-3"], "invalid --repeats=-3"),
    (["--repeats", "0"], "invalid --repeats=0"),
    (["--num-blocks", "0"], "--num-blocks: option(s) of --compare"),
    (["--block-size", "0"], "--block-size: option(s) of --compare"),
    (["--threads-per-stage", "0"], "--threads-per-stage: option(s) of --compare"),
    (["--kernels", "--compare"], "--kernels: option(s) of the grid"),
    (["--compare", "--quick"], "--quick: option(s) of the grid"),
    (["--compare", "--block-size", "0"], "invalid --block-size=0"),
    (["--json", "/proc/nope/x.json"], "invalid --json='/proc/nope/x.json': cannot write in /proc/nope"),
    (["--json", "/dev/null"], "not a regular file"),
])
def test_bad_options_are_one_line_before_any_measurement(argv, needle, capsys):
    assert main(["bench", "engine", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and needle in " ".join(err.split()), err


def test_figures_whose_late_write_fails_are_kept(tmp_path):
    """The write checked at the start can still fail at the end (a disk that filled): the
    figures go to the temporary folder and the error says where."""
    from testbed.run.out_checks import ResultKept, write_or_keep

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ResultKept, match="kept in") as info:
        write_or_keep(blocked / "x.json", '{"a": 1}', "the figures")
    kept = str(info.value).rsplit("kept in ", 1)[1]
    assert open(kept).read() == '{"a": 1}'
