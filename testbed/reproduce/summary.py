"""`testbed reproduce --verdicts [DIR]`: every study's latest full-size verdicts in one table.

Why: the verdict counts quoted in docs/reproduction.md ("26 claims: 4 / 9 / 6 / 3 / 4") were tallied by
hand from nine reports, and the baseline each claim was judged against lived in the study files; an
independent check (2026-11-27) found the docs two cost-model generations behind the runs. This reads
each study's `claims.json` (written by `testbed reproduce <study>`, full size only: `-quick` folders are
smoke tests, not results) and names, per claim, the baseline system exactly as it ran (its grid
overrides from the study file), so the table is re-measured by rerunning the studies and this command.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from engine.base.errors import ConfigError
from testbed.reproduce.studies import MARKER, Claim, Study, list_studies, load_study

# the order the counts are quoted in (docs/reproduction.md)
LABELS = ("reproduced in direction and size", "reproduced in direction only",
          "reproduced in direction (no size published)", "not reproduced",
          "no published number (shown for information)")
SHORT = dict(zip(LABELS, ("size", "direction only", "direction, no size published", "not reproduced",
                          "information")))


@dataclass(frozen=True)
class VerdictRow:
    paper: str
    study: str
    claim: str
    baseline: str  # the system the claim's value is measured against, as it ran
    published: str
    measured: str
    verdict: str  # one of LABELS (or "not assessed")


def baseline_of(study: Study, claim: Claim) -> str:
    """The claim's reference side: a grid system with its overrides, a selector (e.g. 2 GPUs of the
    same system), or '-' for claims about one side only (a spread, a level)."""
    side = dict(claim.b) or ({} if claim.kind == "spread" else None)
    if not side:
        return "-"
    system = side.pop("system", None) or claim.where.get("system")
    grid = next((g for g in study.grids if g.system == system), None) if system else None
    text = f"{system}: `{' '.join(grid.overrides)}`" if grid else (system or "")
    rest = ", ".join(f"{k}={v}" for k, v in side.items())
    return "; ".join(t for t in (text, rest) if t) or "-"


def _measured(entry: dict) -> str:
    value = entry.get("measured")
    if value is None:
        return "-"
    if entry.get("kind") == "ratio" or entry.get("kind") == "value" and entry.get("baseline") == 1.0:
        return f"{value:.3f}x"
    return f"{value:.4g}"


def study_rows(study: Study, folder: Path) -> list[VerdictRow]:
    entries = {e["id"]: e for e in json.loads((folder / "claims.json").read_text())}
    rows = []
    for claim in study.claims:
        e = entries.get(claim.id)
        if e is None:
            raise ConfigError(f"{folder / 'claims.json'} has no claim {claim.id!r}: it was written by another "
                              f"version of study {study.name}; rerun `testbed reproduce {study.name}`")
        label = e.get("verdict_text", "not assessed")
        if label == "reproduced in direction only" and claim.claimed is None:
            label = "reproduced in direction (no size published)"
        rows.append(VerdictRow(study.paper, study.name, claim.text, baseline_of(study, claim), claim.published,
                               _measured(e), label))
    return rows


def collect(root: Path) -> tuple[list[VerdictRow], list[str]]:
    """Rows for every registered study with a finished full-size result under `root`, and one note per
    study that has none (not run, interrupted, or run with overrides: its verdicts are not the default's)."""
    rows: list[VerdictRow] = []
    notes: list[str] = []
    for name in list_studies():
        folder = root / name
        marker = folder / MARKER
        if not marker.is_file() or not (folder / "claims.json").is_file():
            notes.append(f"{name}: no full-size result in {folder} (run `testbed reproduce {name}`)")
            continue
        info = json.loads(marker.read_text())
        if info.get("state") != "done":
            notes.append(f"{name}: its last run is {info.get('state')}, not done; not counted")
            continue
        if info.get("overrides"):
            notes.append(f"{name}: run with overrides {' '.join(info['overrides'])}; not counted")
            continue
        rows += study_rows(load_study(name), folder)
    return rows, notes


def counts_line(rows: list[VerdictRow]) -> str:
    n = Counter(r.verdict for r in rows)
    parts = [f"{n.get(label, 0)} {SHORT[label]}" for label in LABELS]
    other = len(rows) - sum(n.get(label, 0) for label in LABELS)
    return f"{len(rows)} claims: " + " / ".join(parts) + (f" / {other} not assessed" if other else "")


def by_paper(rows: list[VerdictRow]) -> list[str]:
    """The counts per paper (studies of one paper together): a headline count over every study mixes the
    seed papers' claims with the testbed's own hypotheses."""
    head = ["| paper | claims | " + " | ".join(SHORT[label] for label in LABELS) + " |",
            "|---|---:|" + "---:|" * len(LABELS)]
    papers = list(dict.fromkeys(r.paper for r in rows))
    body = []
    for paper in papers:
        n = Counter(r.verdict for r in rows if r.paper == paper)
        body.append(f"| {paper} | {sum(n.values())} | " + " | ".join(str(n.get(label, 0)) for label in LABELS) + " |")
    return head + body


def markdown(rows: list[VerdictRow], notes: list[str], commits: list[str]) -> str:
    lines = ["| study | claim | baseline as run | published | testbed | verdict |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.study} | {r.claim} | {r.baseline} | {r.published} | {r.measured} | {r.verdict} |"
              for r in rows]
    lines += ["", counts_line(rows) + ".", "", *by_paper(rows), ""]
    if commits:
        lines.append("Testbed commit(s) of these results: " + ", ".join(commits) + ".")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


def commits_of(root: Path) -> list[str]:
    found = set()
    for marker in root.glob(f"*/{MARKER}"):
        if not marker.parent.name.endswith("-quick"):
            found.add(str(json.loads(marker.read_text()).get("commit", "not recorded")))
    return sorted(found)


def cli_verdicts(folder: str | None) -> int:
    root = Path(folder or "runs/reproduce")
    if not root.is_dir():
        raise ConfigError(f"no study results in {root}: it is not a folder (the default is runs/reproduce, "
                          f"where `testbed reproduce <study>` writes; valid studies: {', '.join(list_studies())})")
    rows, notes = collect(root)
    text = markdown(rows, notes, commits_of(root))
    (root / "verdicts.md").write_text(text)
    print(text, end="")
    print(root / "verdicts.md")
    return 0
