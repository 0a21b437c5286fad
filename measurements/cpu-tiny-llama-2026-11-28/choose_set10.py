"""Set 10's declared criterion (manifest-set10.yaml header) over `testbed validate --runs manifest-set10.yaml ... --out F` folders.

    python measurements/cpu-tiny-llama-2026-11-28/choose_set10.py F1 F2 ...   (choose-set10.txt)

Per folder: (1) validation groups off by more than 10% on throughput or mean TPOT against the mean of their
repeats, plus the (setting, metric) orders over every fit and validation run that disagree; (2) the mean over the
validation groups of (|throughput error| + |mean TPOT error|) / 2. Smaller wins, in that order.
"""
import json, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[2]))
from testbed.calibrate.rank import Replayed, rank_table
from testbed.calibrate.split_validate import grouped, mean_errors

def score(folder):
    rows = [Replayed(**r) for r in json.load(open(f'{folder}/replays.json'))]
    groups = grouped(rows, 'validation')
    off, crit = [], []
    for key, g in sorted(groups.items()):
        e = mean_errors(g)
        tp, tpot = e['throughput_tok_s'], e['tpot_mean_s']
        crit.append((abs(tp) + abs(tpot)) / 2)
        if abs(tp) > 0.10 or abs(tpot) > 0.10:
            off.append(f'{key[0]} {key[1]} tp {tp:+.1%} tpot {tpot:+.1%}')
    ranks = rank_table([r for r in rows if r.set in ('fit', 'validation')])
    bad = [f"{t['setting']} {t['metric']}" for t in ranks if not t['agree']]
    return len(off) + len(bad), sum(crit) / len(crit), len(groups), len(ranks), off, bad

for f in sys.argv[1:]:
    n, c, ng, nr, off, bad = score(f)
    print(f'{f.split("/")[-1]:28s} score {n}  crit {c:.3%}  groups {ng} orders {nr}  off: {off}  disagree: {bad}')
