"""The 2026-11-28e split (manifest.yaml), judged as declared.

`python measurements/linkbench-2026-11-28e/judge.py choose FIT VAL` (FIT: this folder's series.tar.xz
unpacked; VAL: ../linkbench-2026-11-28d/series.tar.xz unpacked): fits candidates V1-V3 on the fit series
with testbed/linkbench/fit.py, writes each profile to FIT/V*.json, counts points off > 15% on validation
and fit, and names the candidate the criterion chooses.
`python measurements/linkbench-2026-11-28e/judge.py test TEST PROFILE`: the frozen profile on the test
series, every point (all runs; runs not flagged late, diagnostic), and per 400 Mbps run its drops, first
burst and relay lateness per direction."""
import json, statistics, sys
from pathlib import Path
from engine.pricing.tcp_link import load_constants
from testbed.linkbench.fit import main as fit_main, ordered, predict, repeat_means

BIG = (4 << 20, 16 << 20)
FIT = ["fit_15ms_60-200Mbps_r3", "fit_15ms_400Mbps_r15", "fit_35ms_60-200Mbps_r3", "fit_35ms_400Mbps_r15"]
VAL = ["addendum_15ms_400Mbps_perdirection_r10", "addendum_35ms_400Mbps_perdirection_r10",
       "probe_15ms_400Mbps_perdirection_r5"]
TEST = ["test_25ms_60-200Mbps_r3", "test_25ms_400Mbps_r10", "test_45ms_60-200Mbps_r3", "test_45ms_400Mbps_r10"]
CANDIDATES = {"V1": ["--burst-loss", "--modes"], "V2": ["--burst-loss"], "V3": ["--only-slow-burst-p"]}


def points(rows, c):
    rows = ordered(repeat_means(rows))
    return [(r, p / r["measured_s"] - 1.0) for p, r in zip(predict(rows, c), rows)]


def kept_runs(rows):
    """Rows of runs the relays were not late in, repeats renumbered 0.. per (rate, delay) (repeat_means
    groups by repeat number)."""
    keep = {}
    for r in rows:
        if not r["relay_run"]["late"]:
            k = keep.setdefault((r["rate_bps"], r["delay_s"]), {})
            k.setdefault(r["repeat"], len(k))
    return [dict(r, repeat=keep[(r["rate_bps"], r["delay_s"])][r["repeat"]]) for r in rows if not r["relay_run"]["late"]]


def report(label, j):
    errs = [abs(e) for _, e in j]
    off = [(r["rate_bps"] / 1e6, r["n"], r["msgs"], r["gap_s"], f"{e:+.1%}") for r, e in j if abs(e) > 0.15]
    print(f"  {label}: {len(j)} points, off>15% {len(off)}, median {statistics.median(errs):.1%}, max {max(errs):.1%}")
    if off:
        print("    off (Mbps, bytes, msgs, gap, err):", off)
    return len(off)


def runs_of(name, data):
    rows = data["rows"]
    runs = {}
    for r in rows:
        runs.setdefault((r["rate_bps"], r["repeat"]), r)
    lm = [r["relay_run"]["late_mean_s"] * 1e3 for r in runs.values()]
    print(f"== {name} [{data['provenance'].get('relay_layout', 'shared')}] {data['provenance']['date']}: load before "
          f"{data['provenance']['loadavg_before']} after {data['provenance']['loadavg']}; {len(runs)} runs, "
          f"{sum(r['relay_run']['late'] for r in runs.values())} flagged late; relay late mean per run "
          f"{min(lm):.2f}-{max(lm):.2f} ms")
    return rows, runs


def bursts(rows, runs, c):
    kept = sum(r["run_losses"]["drops"] > 1000 for r in runs.values())
    print(f"  first burst survived (run drops > 1,000) in {kept} of {len(runs)} runs (slow_burst_p {c.slow_burst_p:.4f})")
    for (_, k), r in sorted(runs.items(), key=lambda x: x[0][1]):
        t43 = [x["measured_s"] for x in rows if x["repeat"] == k and x["n"] == 4 << 20 and x["msgs"] == 3][0]
        d = r["relay_run"].get("directions") or []
        dirs = " / ".join(f"{x['late_mean_s'] * 1e3:.2f}" for x in d)
        print(f"   run {k}: drops {r['run_losses']['drops']:5d} 4MBx3 {t43 * 1e3:6.1f} ms relay late mean "
              f"{r['relay_run']['late_mean_s'] * 1e3:.2f} (A->B / B->A {dirs}) max {r['relay_run']['late_max_s'] * 1e3:.1f} ms"
              f"{' LATE' if r['relay_run']['late'] else ''}")


def choose(fit_dir: Path, val_dir: Path) -> None:
    fits = [str(fit_dir / f"{n}.json") for n in FIT]
    score = {}
    for name, opts in CANDIDATES.items():
        out = fit_dir / f"{name}.json"
        assert fit_main([str(out)] + [x for f in fits for x in ("--fit", f)] + opts) == 0
        c = load_constants(path=out)
        print(f"=== {name} {' '.join(opts)}: {json.loads(out.read_text())['constants']}")
        val, big = 0, []
        for n in VAL:
            j = points(json.loads((val_dir / f"{n}.json").read_text())["rows"], c)
            val += report(f"validation {n}", j)
            big += [abs(e) for r, e in j if r["n"] in BIG]
        fit_off = sum(report(f"fit {n}", points(json.loads((fit_dir / f"{n}.json").read_text())["rows"], c)) for n in FIT)
        score[name] = (val, fit_off, statistics.median(big))
        print(f"  {name}: validation off {val}, fit off {fit_off}, validation 400 Mbps 4-16 MB median |err| {score[name][2]:.1%}")
    print("chosen (fewest validation off, then fit off, then that median):", min(score, key=lambda k: score[k]))


def test(test_dir: Path, profile: Path) -> None:
    c = load_constants(path=profile)
    total = 0
    for n in TEST:
        data = json.loads((test_dir / f"{n}.json").read_text())
        rows, runs = runs_of(n, data)
        j = points(rows, c)
        total += report("all runs", j)
        for r, e in j:
            print(f"    {r['rate_bps'] / 1e6:4.0f} Mbps {r['n']:>9,} B x{r['msgs']} gap {r['gap_s']:g}: measured "
                  f"{r['measured_s'] * 1e3:8.1f} ms (±{r.get('spread', 0) / 2:.0%}) modelled "
                  f"{r['measured_s'] * (1 + e) * 1e3:8.1f} ms {e:+.1%}{' **' if abs(e) > 0.15 else ''}")
        kept = kept_runs(rows)
        report("runs not flagged late (diagnostic)", points(kept, c)) if kept else print("  no run unflagged")
        if "400Mbps" in n:
            bursts(rows, runs, c)
    print(f"TEST: {total} points off > 15% -> target {'MET' if total == 0 else 'NOT met'}")


if __name__ == "__main__":
    {"choose": choose, "test": test}[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
