"""`testbed reproduce <study>`: rerun a seed paper's headline experiments in simulation and say,
claim by claim, whether the testbed reproduces what the paper published.

    testbed reproduce --list
    testbed reproduce tdpipe-scaling
    testbed reproduce gllm-rates --quick
    testbed reproduce gllm-rates hardware=h100-80g policy.T=16      # your profile / hyperparameters
    testbed reproduce my-study.yaml                                  # a study file of your own

A study is a YAML file in `testbed/studies/` (found next to this module, so an editable install
and a source checkout both see it) plus the generic code below:

- `base`, `parts` (setups, e.g. one per GPU + model) and `grids` (systems, e.g. one per policy),
  each a list of `key=value` overrides; a comma list is an axis, as in `testbed compare`. Every
  grid runs in every part (or in the parts it names); the points are `testbed compare` points
  (`compare.grid`), run by the shared sweep runner (`testbed/sweep/jobs.py`), all nested under one
  parent MLflow run in experiment `reproduce-<study>` (`reproduce-<study>-quick` with `--quick`).
- `quick` lists (study, part or grid level) replace keys in `--quick` mode: fewer requests and
  sweep points, for CI smoke tests.
- `policy`: alternatives, the first whose policy is registered (and composes) is used for every
  run; e.g. SiPipe's study uses `policy=sipipe` once it lands, else Sarathi with the runtime.*
  switches.
- `claims`: what the paper states, each computed from the table (a ratio of two systems, a
  value, or a spread over a sweep) and judged by `verdict` (the rules are in its docstring and in
  every report).
- `figures`: which rows to plot against which x (`report.plot_comparison`).

Extra `key=value` overrides on the command line apply to every run, where meaningful: a key the
study sets is replaced (a comma list is allowed only for a key that is already an axis, e.g.
`workload.rate=1,2,4`); `policy.<param>=` goes only to the runs whose policy has that parameter;
`policy=` is refused when the study compares several policies (it would make them all one).

Output: `<output.dir>/reproduce/<study>[-quick]/` with `report.md` (setup, claim table with the
published value beside the testbed's, verdict lines, figures, result table), `claims.json`,
`table.csv`, `table.md`, `figures/` and `runs/<point>/`. Identical runs (e.g. 1 GPU with "PP" or
"TP") run once. The last line printed is the report's path. Ctrl-C or SIGTERM stops at once:
the table of the points done so far is written, the MLflow runs end KILLED, exit 130 / 143.

Modules: studies (the YAML format), verdicts (the rules), claims (evaluating them on the
table), planning (overrides -> points), render (figures, report.md), run (the command).
"""
from testbed.reproduce.claims import ClaimResult, evaluate_claim, format_value, select
from testbed.reproduce.planning import Planned, derived_columns, merge, plan, study_axes
from testbed.reproduce.render import render_report, write_figures
from testbed.reproduce.run import MARKER, StudyOutcome, cli_reproduce, run_study
from testbed.reproduce.studies import (Claim, FigureSpec, GridSpec, Part, Study, describe_studies, list_studies,
                                       load_study, studies_dir)
from testbed.reproduce.verdicts import VERDICT_TEXT, Verdict, verdict

__all__ = ["MARKER", "VERDICT_TEXT", "Claim", "ClaimResult", "FigureSpec", "GridSpec", "Part", "Planned", "Study",
           "StudyOutcome", "Verdict", "cli_reproduce", "derived_columns", "describe_studies", "evaluate_claim",
           "format_value", "list_studies", "load_study", "merge", "plan", "render_report", "run_study", "select",
           "studies_dir", "study_axes", "verdict", "write_figures"]
