"""`testbed tune`: search a policy's hyperparameters with Optuna, every trial a nested MLflow run.

    testbed tune policy=sarathi workload=azure tune.trials=50 tune.objective=throughput
    testbed tune policy=sarathi tune.objective=[throughput,ttft_p99_s] tune.workers=2
    testbed tune policy=sarathi 'tune.constraints=[slo_attainment>=0.9]' tune.space.parallel.pp=2,4
    testbed tune policy=gllm tune.space.parallel.num_microbatches=4,5,6,8

The `tune.*` keys are not part of the composed run config: they are split off before `compose`
and parsed into `TuneSettings` (settings.py). Everything else is an ordinary run override and
defines the *base* config every trial starts from.

What is searched (space.py): the policy's own `search_space(trial)`, the micro-batch count
`parallel.num_microbatches` in [P, 2P] (unless pinned on the command line or given its own
`tune.space.` entry), plus optional extra keys `tune.space.<config key>=<spec>` (`2,4`
categorical, `1:8` int range, `0.5:0.95` float range, `128:4096:log`, `0:0.2:0.05` stepped,
`tune.space.runtime.*=true,false` for every key of a section). A policy parameter set explicitly
on the command line (`policy.token_budget=512`) is held fixed instead of searched. Trial 0 is the
base config (the policy's defaults; an unset micro-batch count is tried as P).

Modules: objectives (metrics, directions, constraints), settings, space, problem (base config,
fingerprint, study name), storage (Optuna RDB/journal, first-use lock, samplers), trial (one
trial), workers (processes on one study), display, figures, tracking (the study's MLflow run),
command (the command itself).

Study and storage: `sqlite:///<output.dir>/optuna.db` by default, never the MLflow database; any
Optuna RDB URL or `journal:<file>` works. A study is created once and resumed on every later call
with the same name; the default name carries a hash of the problem. Seeding: the sampler is
seeded from `seed` (or `tune.seed`); with one worker the same seed gives the same trials; worker
i of N uses seed + i, so parallel runs are not reproducible trial by trial.

Stopping: Ctrl-C or SIGTERM marks running trials interrupted (they do not count), ends their
MLflow runs and the study run KILLED, writes `trials.csv` and `best.json`, and exits 130 / 143;
running the same command again resumes. Workers stop by themselves when the parent dies.

Watching a study: studies name their metrics (`study.set_metric_names`), so optuna-dashboard
labels its axes. Install the extra and point it at the study's storage:

    pip install -e '.[dashboard]'
    optuna-dashboard sqlite:///runs/optuna.db          # then open http://127.0.0.1:8080

Open it when the study is finished, or on a copy while it runs
(`sqlite3 runs/optuna.db ".backup /tmp/optuna-copy.db"`, then `optuna-dashboard
sqlite:////tmp/optuna-copy.db`): pointing optuna-dashboard at the SQLite file of a running study
has crashed the study (optuna-dashboard issue 545). For a live view use PostgreSQL storage.
"""
from testbed.tune.command import TuneOutcome, cli_tune, finish_study, open_study, print_outcome, run_tune
from testbed.config.objectives import SCALAR_KEYS, Constraint, resolve_metric
from testbed.tune.problem import Problem, prepare
from testbed.tune.settings import TuneSettings, parse_settings
from testbed.tune.space import SpaceSpec
from testbed.tune.workers import worker_loop

__all__ = ["SCALAR_KEYS", "Constraint", "Problem", "SpaceSpec", "TuneOutcome", "TuneSettings", "cli_tune",
           "finish_study", "open_study", "parse_settings", "prepare", "print_outcome", "resolve_metric",
           "run_tune", "worker_loop"]
