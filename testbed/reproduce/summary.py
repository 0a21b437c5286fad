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
from testbed.reproduce.claims import format_value
from testbed.reproduce.studies import MARKER, Claim, Study, list_studies, load_study
from testbed.reproduce.verdicts import UNSIZED_TEXT, VERDICT_TEXT

# the verdicts counted, in the order the counts are quoted in (docs/reproduction.md); "not assessed"
# (VERDICT_TEXT["n/a"]) is counted apart
LABELS = (VERDICT_TEXT["size"], VERDICT_TEXT["direction"], UNSIZED_TEXT, VERDICT_TEXT["none"], VERDICT_TEXT["info"])
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
    verdict: str  # one of LABELS, or VERDICT_TEXT["n/a"]


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


def study_rows(study: Study, folder: Path) -> list[VerdictRow]:
    entries = {e["id"]: e for e in json.loads((folder / "claims.json").read_text())}
    rows = []
    for claim in study.claims:
        e = entries.get(claim.id)
        if e is None:
            raise _stale(folder, study.name, f"has no claim {claim.id!r}")
        rows.append(VerdictRow(study.paper, study.name, claim.text, baseline_of(study, claim), claim.published,
                               format_value(claim, e.get("measured")), _label(e, folder, study.name)))
    return rows


def _label(entry: dict, folder: Path, study: str) -> str:
    """The verdict as the study's report printed it: `verdict_text` is `Verdict.label`, written by
    `ClaimResult.as_dict` (so a claim published without a number already reads "no size published": all
    nine full-size claims.json of 2026-11-29 do); text from another version is an error, not a guess."""
    label = entry.get("verdict_text", VERDICT_TEXT["n/a"])
    valid = (*LABELS, VERDICT_TEXT["n/a"])
    if label not in valid:
        raise _stale(folder, study, f"gives claim {entry.get('id')!r} the verdict {label!r}, not one of "
                                    f"{', '.join(map(repr, valid))}")
    return label


def _stale(folder: Path, study: str, what: str) -> ConfigError:
    return ConfigError(f"{folder / 'claims.json'} {what}: it was written by another version of study {study}; "
                       f"rerun `testbed reproduce {study}`")


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
    return f"{len(rows)} claims: " + " / ".join(parts) + (f" / {other} {VERDICT_TEXT['n/a']}" if other else "")


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
