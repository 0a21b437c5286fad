"""The 2026-11-28g split (manifest.yaml), judged as declared: 2026-11-28f's judge (that folder's judge.py,
its code unchanged, imported) run with this split's names and candidates.

`python measurements/linkbench-2026-11-28g/judge.py choose SERIES`: SERIES holds 28f's series.tar.xz AND
test-series.tar.xz unpacked (this round's fit pool = 28f's fit_* + val_*, its validation = 28f's test_*);
M3 and M2 are fitted on the fit pool with testbed/linkbench/fit.py (profiles written to SERIES/M*.json),
the validation points off > 15% counted, and the criterion's choice named (M3 listed first: the simpler,
the last tie-break).
`python measurements/linkbench-2026-11-28g/judge.py test SERIES PROFILE`: the frozen profile on this
round's test series (this folder's test-series.tar.xz unpacked); writes test-table.json beside this script."""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("judge28f", Path(__file__).parents[1] / "linkbench-2026-11-28f" / "judge.py")
j28f = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(j28f)

j28f.FIT = ["fit_15ms_60-200Mbps_r2", "fit_15ms_400Mbps_r8", "fit_35ms_60-200Mbps_r2", "fit_35ms_400Mbps_r8",
            "val_30ms_60-200Mbps_r2", "val_30ms_400Mbps_r6"]
j28f.VAL = ["test_20ms_60-200Mbps_r3", "test_20ms_400Mbps_r8", "test_40ms_60-200Mbps_r3", "test_40ms_400Mbps_r8"]
j28f.TEST = ["test_25ms_60-200Mbps_r3", "test_25ms_400Mbps_r8", "test_45ms_60-200Mbps_r3", "test_45ms_400Mbps_r8"]
j28f.CANDIDATES = {"M3": ["--burst-loss", "--lost-window"], "M2": ["--burst-loss", "--modes", "--lost-window"]}
j28f.__file__ = __file__  # 28f's test() writes test-table.json beside "its" script: here, not in 28f's folder

if __name__ == "__main__":
    if sys.argv[1:2] == ["choose"] and len(sys.argv) == 3:
        j28f.choose(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["test"] and len(sys.argv) == 4:
        j28f.test(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        print(f"error: arguments {sys.argv[1:]}: valid: choose SERIES | test SERIES PROFILE")
        sys.exit(2)
