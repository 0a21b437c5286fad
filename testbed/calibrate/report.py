"""`testbed calibrate tables`: the command (testbed/calibrate/tables.py does the work).

Two modes: the published tables (fit every device, report, optionally `--save` the fitted
hardware profiles), and `--profile CSV` (a profile measured on the user's own GPU, in
`testbed profile`'s format, judged against a hardware profile: errors by family and bucket).
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pandas as pd

from engine.pricing.profile_table import OPERATOR_OPS, ProfileTable
from engine.pricing.costmodel import CostModel
from engine.base.errors import ConfigError
from testbed.calibrate.gpu_tables import DEVICES
from engine.pricing.hardware import get_hardware
from testbed.calibrate.kernel_fit import DEFAULT_FIT_MODELS
from testbed.run.out_checks import writable_dir
from testbed.calibrate.run_checks import read_table
from engine.pricing.models import get_model

__all__ = ["cli_calibrate", "profile_errors"]


def _devices(text: str) -> list[str]:
    devices = list(DEVICES) if text == "all" else [d.strip() for d in text.split(",") if d.strip()]
    bad = [d for d in devices if d not in DEVICES]
    if bad or not devices:
        raise ConfigError(f"invalid --device {text!r}; valid: {', '.join(DEVICES)}, all (or a comma list)")
    return devices


def _fit_models(holdout: str | None, directory: Path) -> tuple[str, ...]:
    if not holdout:
        return DEFAULT_FIT_MODELS
    from testbed.calibrate.gpu_tables import TABLES_SUBDIR

    root = directory / TABLES_SUBDIR if (directory / TABLES_SUBDIR).is_dir() else directory
    models = sorted({p.parent.name for p in (root / "compute").glob("*/*/*/mlp.csv")})
    held = {m.strip() for m in holdout.split(",") if m.strip()}
    unknown = sorted(held - set(models))
    if unknown:
        raise ConfigError(f"invalid --holdout {', '.join(unknown)}; valid models: {', '.join(models)}")
    return tuple(m for m in models if m not in held)


def cli_calibrate(args, console) -> int:
    from testbed.calibrate.tables import run_tables, tables_dir

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = writable_dir("--out", args.out or f"runs/calibrate/tables-{stamp}")  # before minutes of fitting
    if args.save:
        writable_dir("--save", args.save)
    if args.profile:
        table = read_table(args.profile)
        if any(r.op in OPERATOR_OPS for r in table.rows):
            return _operator_profile(table, args, out, console)
        df = profile_errors(table, args.hardware)
        out.mkdir(parents=True, exist_ok=True)
        table = summarise_profile(df)
        table.to_csv(out / "profile_errors.csv", index=False)
        console.print(table.to_string(index=False) if not args.json else json.dumps(table.to_dict("records"), default=float))
        console.print(f"report: {out}")
        return 0
    directory = tables_dir(args.dir)
    report = run_tables(directory, _devices(args.device), _fit_models(args.holdout, directory), out,
                        Path(args.save) if args.save else None, console)
    if args.json:
        print(json.dumps(report["headline"], default=float, indent=1))
    else:
        for device, rows in report["headline"].items():
            table = pd.DataFrame(rows)[["family", "rows", "fitted_median", "fitted_p90", "fitted_max", "fitted_bias",
                                        "default_median", "default_bias", "target"]].astype({"rows": int})
            print(f"\n{device}: held-out error by family (fitted = the shipped profile; default = the roofline)")
            print(table.to_string(index=False, na_rep="", float_format=lambda v: f"{100 * v:.1f}%"))
        if report["by_shape"]:
            shapes = pd.DataFrame(report["by_shape"])[["device", "family", "shape", "gqa", "rows", "fitted_median",
                                                       "fitted_bias", "default_median"]]
            print("\nattention by held-out shape (fitted on the other shapes)")
            print(shapes.to_string(index=False, na_rep="", float_format=lambda v: f"{100 * v:.1f}%"))
    console.print(f"report: {out / 'report.md'} (figures: linear.png, attention.png)")
    return 0


def _operator_profile(table: ProfileTable, args, out: Path, console) -> int:
    """Fit kernel coefficients to a user's operator-level profile (the published tables' fit,
    unchanged) and report its error by family; `--save DIR` writes it as hardware profile
    `<--hardware>-fit` (peaks from --hardware)."""
    from dataclasses import replace as _replace

    from testbed.calibrate.gpu_tables import tables_from_profile
    from testbed.calibrate.kernel_fit import Device
    from testbed.calibrate.tables import error_frame, fitted_spec, summarise

    if not args.hardware:
        raise ConfigError("--profile with operator rows needs --hardware (the GPU whose datasheet peaks the "
                          "efficiencies are fractions of), e.g. --hardware a100-80g-roofline")
    base = get_hardware(args.hardware)
    tables = tables_from_profile(table, base.name)
    from testbed.calibrate.kernel_fit import fit_kernels

    device = Device(base.name, base.peak_flops, base.mem_bw_Bps, base.sm_count)
    model = next(iter(tables.compute), table.meta.get("model", "profile"))
    fit = fit_kernels(list(tables.compute.values()), tables.attention, tables.network, tables.host, device,
                      fit_models=(model,), base=None)
    name = f"{base.name.removesuffix('-roofline')}-fit"
    fitted = fitted_spec(base, name, fit, f"{base.description.split(';')[0]}; kernels fitted to {args.profile}",
                         f"profile-{_dt.date.today().isoformat()}")
    df = error_frame(tables, fit, fitted, _replace(base, kernels=None))
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(df, ["family"]).astype({"rows": int})
    summary.to_csv(out / "profile_errors.csv", index=False)
    print(summary.to_string(index=False, na_rep="", float_format=lambda v: f"{100 * v:.1f}%"))
    if args.save:
        from testbed.calibrate.fit import save_hardware_profile

        path = save_hardware_profile(fitted, Path(args.save) / f"{name}.yaml",
                                     extra={"source": str(args.profile), "notes": fit.notes})
        console.print(f"saved hardware profile {name} -> {path}")
    console.print(f"report: {out}")
    return 0


def profile_errors(table: ProfileTable, hardware: str | None) -> pd.DataFrame:
    """A user's profile (forward rows, as `testbed profile` writes them) against a hardware
    profile: relative error per row, bucketed by kind and tokens / batch x context."""
    name = hardware or table.meta.get("hardware")
    model_name = table.meta.get("model")
    if not name or not model_name:
        raise ConfigError("the profile names no hardware or model in its metadata; pass --hardware "
                          "(and profile a table with '# model=...')")
    cost = CostModel(get_model(model_name), get_hardware(name), pp=int(table.meta.get("pp", "1")))
    rows = []
    for r in table.select("forward"):
        shape = r.shape()
        pred = cost.stage_compute_s(r.stage if r.stage is not None else -1, shape)
        size = shape.num_tokens if r.kind != "decode" else r.batch * r.context
        rows.append(dict(family=r.kind, x=size, measured=r.time_s, predicted=pred, err=pred / r.time_s - 1.0))
    if not rows:
        raise ConfigError("the profile has no forward rows to judge")
    return pd.DataFrame(rows)


def summarise_profile(df: pd.DataFrame) -> pd.DataFrame:
    g = df.assign(abs_err=df.err.abs()).groupby("family")
    return pd.DataFrame({"rows": g.size(), "median": g.abs_err.median(), "p90": g.abs_err.quantile(0.9),
                         "max": g.abs_err.max(), "bias": g.err.median()}).reset_index()
