"""The 2026-11-28f split (manifest.yaml), judged as declared.

`python measurements/linkbench-2026-11-28f/judge.py choose SERIES` (SERIES: this folder's series.tar.xz
unpacked): M0 is the shipped gloo-tcp profile; M1 and M2 are fitted on the fit series with
testbed/linkbench/fit.py (profiles written to SERIES/M*.json); counts validation points off > 15% and
names the candidate the criterion chooses.
`python measurements/linkbench-2026-11-28f/judge.py test SERIES PROFILE`: the frozen profile on the test
series (test-series.tar.xz unpacked), every point; per 400 Mbps run its drops and relay lateness.
The printing helpers are 2026-11-28e's judge (imported from that folder, unchanged)."""
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from engine.pricing.tcp_link import load_constants
from testbed.linkbench.fit import main as fit_main

_spec = importlib.util.spec_from_file_location("judge28e", Path(__file__).parents[1] / "linkbench-2026-11-28e" / "judge.py")
j28e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(j28e)
points, report, runs_of, bursts = j28e.points, j28e.report, j28e.runs_of, j28e.bursts

BIG = (4 << 20, 16 << 20)
FIT = ["fit_15ms_60-200Mbps_r2", "fit_15ms_400Mbps_r8", "fit_35ms_60-200Mbps_r2", "fit_35ms_400Mbps_r8"]
VAL = ["val_30ms_60-200Mbps_r2", "val_30ms_400Mbps_r6"]
TEST = ["test_20ms_60-200Mbps_r3", "test_20ms_400Mbps_r8", "test_40ms_60-200Mbps_r3", "test_40ms_400Mbps_r8"]
CANDIDATES = {"M0": None, "M1": ["--burst-loss", "--modes"], "M2": ["--burst-loss", "--modes", "--lost-window"]}


def candidate(name: str, series: Path):
    opts = CANDIDATES[name]
    if opts is None:
        return load_constants(), "the shipped gloo-tcp.json"
    out = series / f"{name}.json"
    assert fit_main([str(out)] + [x for n in FIT for x in ("--fit", str(series / f"{n}.json"))] + opts) == 0
    return load_constants(path=out), json.loads(out.read_text())["constants"]


def choose(series: Path) -> None:
    score = {}
    for rank, name in enumerate(CANDIDATES):
        c, what = candidate(name, series)
        print(f"=== {name}: {what}")
        val, big = 0, []
        for n in VAL:
            rows, _ = runs_of(n, json.loads((series / f"{n}.json").read_text()))
            j = points(rows, c)
            val += report(f"validation {n}", j)
            big += [abs(e) for r, e in j if r["n"] in BIG and r["rate_bps"] == 400e6]
        for n in FIT:
            report(f"fit {n}", points(json.loads((series / f"{n}.json").read_text())["rows"], c))
        score[name] = (val, statistics.median(big) if big else 0.0, rank)
        print(f"  {name}: validation off {val}, validation 400 Mbps 4-16 MB median |err| {score[name][1]:.1%}")
    print("chosen (fewest validation off, then that median, then the simpler):", min(score, key=lambda k: score[k]))


def test(series: Path, profile: Path) -> None:
    """Also writes test-table.json beside this script: every test point (the mean over its repeats, the
    frozen model's time), for tests/test_link_profile_28f.py."""
    c = load_constants(path=profile)
    total, worst, table = 0, [], []
    for n in TEST:
        rows, runs = runs_of(n, json.loads((series / f"{n}.json").read_text()))
        j = points(rows, c)
        total += report("all runs", j)
        keep = ("rate_bps", "delay_s", "n", "msgs", "gap_s", "measured_s", "repeats", "spread")
        table += [{k: r[k] for k in keep if k in r} | {"series": n, "modelled_s": r["measured_s"] * (1 + e)}
                  for r, e in j]
        for r, e in j:
            worst.append((abs(e), f"{n}: {r['rate_bps'] / 1e6:g} Mbps {r['n']:,} B x{r['msgs']} gap {r['gap_s']:g} {e:+.1%}"))
            print(f"    {r['rate_bps'] / 1e6:4.0f} Mbps {r['n']:>9,} B x{r['msgs']} gap {r['gap_s']:g}: measured "
                  f"{r['measured_s'] * 1e3:8.1f} ms (±{r.get('spread', 0) / 2:.0%}) modelled "
                  f"{r['measured_s'] * (1 + e) * 1e3:8.1f} ms {e:+.1%}{' **' if abs(e) > 0.15 else ''}")
        if "400Mbps" in n:
            bursts(rows, runs, c)
    (Path(__file__).parent / "test-table.json").write_text(json.dumps({"profile": profile.name, "points": table}, indent=1) + "\n")
    print("worst points:", *[w for _, w in sorted(worst, reverse=True)[:5]], sep="\n  ")
    print(f"TEST: {total} of {len(worst)} points off > 15% -> target {'MET' if total == 0 else 'NOT met'}")


if __name__ == "__main__":
    if sys.argv[1] == "choose":
        choose(Path(sys.argv[2]))
    else:
        test(Path(sys.argv[2]), Path(sys.argv[3]))
