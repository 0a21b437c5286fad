"""Judge the shipped (frozen) link model on the 2026-11-28d test series: all runs, and only runs the relays
were not late in (rows' relay_run.late); per 400 Mbps run: lateness (per direction where there are two
relays), drops, whether the first burst survived. The probe series (shared vs per-direction relays) are
reported for lateness and bursts only, not judged (manifest.yaml).

`python measurements/linkbench-2026-11-28d/judge.py FOLDER` (FOLDER: series.tar.xz unpacked)."""
import json, statistics, sys
from pathlib import Path
from engine.pricing.tcp_link import load_constants
from testbed.linkbench.fit import ordered, predict, repeat_means

c = load_constants()
folder = Path(sys.argv[1])
BIG = (4 << 20, 16 << 20)

def judge(rows):
    rows = ordered(repeat_means(rows))
    return [(r, p / r["measured_s"] - 1.0) for p, r in zip(predict(rows, c), rows)]

def renumber(rows):  # repeat_means wants a repeat 0 per (rate, delay): keep the kept runs' order
    keep = {}
    for r in rows:
        keep.setdefault((r["rate_bps"], r["delay_s"]), {}).setdefault(r["repeat"], len(keep[(r["rate_bps"], r["delay_s"])]))
    return [dict(r, repeat=keep[(r["rate_bps"], r["delay_s"])][r["repeat"]]) for r in rows]

PROBES = ["probe_15ms_400Mbps_shared_r5", "probe_15ms_400Mbps_perdirection_r5"]
TESTS = ["test_15ms_60-200Mbps_r3", "test_15ms_400Mbps_r10", "test_35ms_60-200Mbps_r3", "test_35ms_400Mbps_r10",
         "addendum_15ms_400Mbps_perdirection_r10", "addendum_35ms_400Mbps_perdirection_r10"]

def directions(run):
    d = run.get("directions")
    return "" if not d else " (A->B {:.2f} / B->A {:.2f} ms)".format(*(x["late_mean_s"] * 1e3 for x in d))

for name in PROBES + TESTS:
    f = folder / f"{name}.json"
    if not f.exists():
        print(name, "missing"); continue
    data = json.loads(f.read_text()); rows = data["rows"]
    runs = {}
    for r in rows:
        runs.setdefault((r["rate_bps"], r["repeat"]), r)
    flagged = sum(r["relay_run"]["late"] for r in runs.values())
    lm = [r["relay_run"]["late_mean_s"] * 1e3 for r in runs.values()]
    print(f"== {name} [{data['provenance'].get('relay_layout', 'shared')}]: load before {data['provenance']['loadavg_before']} after {data['provenance']['loadavg']}; "
          f"{len(runs)} runs, {flagged} flagged late; relay late mean per run {min(lm):.2f}-{max(lm):.2f} ms "
          f"(mean {statistics.mean(lm):.2f}), worst {max(r['relay_run']['late_max_s'] for r in runs.values())*1e3:.1f} ms")
    for label, sel in (() if name in PROBES else (("all", rows), ("not late", renumber([r for r in rows if not r["relay_run"]["late"]])))):
        if not sel:
            print(f"  {label}: no runs"); continue
        j = judge(sel)
        errs = [abs(e) for _, e in j]
        off = [(r["rate_bps"] / 1e6, r["n"], r["msgs"], r["gap_s"], r.get("repeats", 1), f"{e:+.1%}") for r, e in j if abs(e) > 0.15]
        big400 = [(r["n"] >> 20, r["msgs"], f"{e:+.1%}", r.get("repeats", 1)) for r, e in j if r["rate_bps"] == 400e6 and r["n"] in BIG]
        print(f"  {label}: {len(j)} points, off>15% {len(off)}, median {statistics.median(errs):.1%}, max {max(errs):.1%}")
        if off: print("    off:", off)
        if big400: print("    400 Mbps 4-16 MB (MB, msgs, err, repeats):", big400)
    if "400Mbps" in name:
        kept = sum(r["run_losses"]["drops"] > 1000 for r in runs.values())
        print(f"  first burst survived in {kept} of {len(runs)} runs (slow_burst_p {c.slow_burst_p:.3f})")
        for (rate, k), r in sorted(runs.items(), key=lambda x: x[0][1]):
            t43 = [x["measured_s"] for x in rows if x["repeat"] == k and x["n"] == 4 << 20 and x["msgs"] == 3][0]
            print(f"   run {k}: drops {r['run_losses']['drops']:5d} burst {'survived' if r['run_losses']['drops'] > 1000 else 'lost    '} "
                  f"4MBx3 {t43*1e3:6.1f} ms  relay late mean {r['relay_run']['late_mean_s']*1e3:.2f} max {r['relay_run']['late_max_s']*1e3:.1f} ms {'LATE' if r['relay_run']['late'] else ''}{directions(r['relay_run'])}")
