"""The report's data: a run folder read into DataFrames, and one function per chart that shapes its frame.

Every function here is pure pandas (no plotting) so the numbers behind each chart are unit-tested. A run
folder (``dtune search --out DIR``) holds ``run.json``, ``study.db``, ``trials.csv`` and ``tuned.json``;
``dtune bench`` and ``dtune profile`` may add ``bench.csv`` and ``profile.csv``. Anything may be missing:
loaders return None and the report says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dtune.measure.work import Roofs
from dtune.tune.results import MEASURED

SHAPE_COLS = ["B", "T", "H", "HV", "K", "V"]
PROFILE_TOTAL = "total (whole op)"


@dataclass
class RunData:
    """Everything a run folder holds (None where a file is absent or unreadable), plus load problems."""

    path: Path
    run: dict[str, Any] = field(default_factory=dict)
    trials: pd.DataFrame | None = None
    tuned: dict[str, Any] | None = None
    bench: pd.DataFrame | None = None
    profile: pd.DataFrame | None = None
    study_db: Path | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.resolve().name


def _read_csv(path: Path, problems: list[str]) -> pd.DataFrame | None:
    if not path.exists():
        return None
    try:
        frame = pd.read_csv(path)
    except Exception as exc:  # a half-written or empty CSV must not break the report
        problems.append(f"{path.name}: {type(exc).__name__}: {exc}")
        return None
    return frame if len(frame) else None


def _read_json(path: Path, problems: list[str]) -> Any:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except Exception as exc:
        problems.append(f"{path.name}: {type(exc).__name__}: {exc}")
        return None


def load_run(path: str | Path) -> RunData:
    """Read a run folder; missing files stay None, unreadable ones are listed in ``problems``."""
    path = Path(path)
    problems: list[str] = []
    run = _read_json(path / "run.json", problems)
    db = path / "study.db"
    return RunData(
        path=path,
        run=run if isinstance(run, dict) else {},
        trials=_read_csv(path / "trials.csv", problems),
        tuned=_read_json(path / "tuned.json", problems),
        bench=_read_csv(path / "bench.csv", problems),
        profile=_read_csv(path / "profile.csv", problems),
        study_db=db if db.exists() else None,
        problems=problems,
    )


def shape_label(row: Any) -> str:
    """``B4 T1024 H16 D128`` (``K/V`` when they differ) from anything with B, T, H, K, V."""
    k, v = int(row["K"]), int(row["V"])
    d = f"D{k}" if k == v else f"K{k}/V{v}"
    return f"B{int(row['B'])} T{int(row['T'])} H{int(row['H'])} {d}"


# --------------------------------------------------------------------------------------------- summary


def environment(run: dict[str, Any]) -> dict[str, str]:
    """The run's environment as label -> text: GPU, its roofs, versions, commit, sampler, when."""
    gpu = run.get("gpu") or {}
    versions = run.get("versions") or {}
    out: dict[str, str] = {}
    if gpu:
        out["GPU"] = (
            f"{gpu.get('name', '?')} ({gpu.get('key', '?')}, sm_{gpu.get('cc_major', '?')}{gpu.get('cc_minor', '')})"
        )
        out["GPU roofs"] = (
            f"{gpu.get('hbm_gbs', '?')} GB/s HBM, {gpu.get('bf16_tflops', '?')} TFLOP/s bf16, "
            f"{gpu.get('sm_count', '?')} SMs, {gpu.get('l2_mb', '?')} MB L2 (source: {gpu.get('source', '?')})"
        )
    for key in ("kernel", "dtype", "sampler", "commit", "created"):
        if key in run:
            out[key.capitalize()] = str(run[key])
    if "interpret" in run:
        out["Interpreter"] = "yes — times are NOT meaningful" if run["interpret"] else "no (GPU timings)"
    if versions:
        out["Versions"] = ", ".join(f"{k} {v}" for k, v in versions.items())
    shapes = run.get("shapes") or []
    if shapes:
        out["Shapes"] = f"{len(shapes)}: " + ", ".join(str(s.get("shape_key", "?")) for s in shapes)
    return out


def _param_cols(trials: pd.DataFrame) -> list[str]:
    return [c for c in trials.columns if c.startswith("p.")]


def best_per_shape(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per study (kernel, dtype, shape): best complete time, the default's time, speedup, counts, config."""
    keys = ["study", "kernel", "dtype", "shape_key", *SHAPE_COLS]
    keys = [k for k in keys if k in trials.columns]
    rows = []
    for key, grp in trials.groupby(keys, dropna=False, sort=True):
        done = grp[(grp["state"] == "complete") & grp["time_ms"].notna()]
        rec: dict[str, Any] = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        rec["complete"] = int((grp["state"] == "complete").sum())
        rec["failed"] = int((grp["state"] == "failed").sum())
        rec["pruned"] = int((grp["state"] == "pruned").sum())
        default_ms = math.nan
        if "is_default" in grp.columns:
            d = done[done["is_default"].astype(bool)]
            if len(d):
                default_ms = float(d["time_ms"].min())
        if math.isnan(default_ms) and "default_time_ms" in grp.columns and grp["default_time_ms"].notna().any():
            default_ms = float(grp["default_time_ms"].dropna().median())
        if len(done):
            best = done.loc[done["time_ms"].idxmin()]
            rec["best_ms"] = float(best["time_ms"])
            rec["best_trial"] = int(best["number"])
            params = {c[2:]: _plain(best[c]) for c in _param_cols(trials) if pd.notna(best[c])}
            rec["config"] = json.dumps(params, sort_keys=True)
            rec["error_o"] = float(best["error_o"]) if "error_o" in best and pd.notna(best["error_o"]) else math.nan
        else:
            rec.update(best_ms=math.nan, best_trial=-1, config="", error_o=math.nan)
        rec["default_ms"] = default_ms
        rec["speedup"] = default_ms / rec["best_ms"] if rec["best_ms"] > 0 else math.nan
        rows.append(rec)
    return pd.DataFrame(rows)


def compact_config(text: Any) -> str:
    """``{"BT": 64, "num_warps": 4}`` (JSON text) -> ``BT=64 num_warps=4``; anything else unchanged."""
    try:
        cfg = json.loads(text) if isinstance(text, str) and text else None
    except json.JSONDecodeError:
        return str(text)
    if not isinstance(cfg, dict):
        return "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text)
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def _plain(x: Any) -> Any:
    """numpy scalars -> Python, floats that are whole -> int (trial params read back from CSV as floats)."""
    if hasattr(x, "item"):
        x = x.item()
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def tuned_frame(tuned: dict[str, Any] | None) -> pd.DataFrame | None:
    """tuned.json's entries, flattened: kernel, dtype, B..V (the bucket), times, speedup, gate error, config."""
    if not tuned or not tuned.get("entries"):
        return None
    rows = []
    for e in tuned["entries"]:
        b = e.get("bucket", {})
        trials = e.get("trials", {})
        rows.append(
            {
                "kernel": e.get("kernel"),
                "dtype": e.get("dtype"),
                **{c: b.get(c, math.nan) for c in SHAPE_COLS},
                "best_ms": e.get("time_ms", math.nan),
                "default_ms": e.get("default_time_ms", math.nan),
                "speedup": e.get("speedup", math.nan),
                "gate_error": e.get("gate_error", math.nan),
                "config": json.dumps(e.get("config", {}), sort_keys=True),
                "complete": trials.get("complete", 0),
                "failed": trials.get("failed", 0),
                "pruned": trials.get("pruned", 0),
            }
        )
    return pd.DataFrame(rows)


def speedups(data: RunData) -> pd.DataFrame | None:
    """Best vs default per shape: from trials.csv when present, else from tuned.json."""
    if data.trials is not None and {"state", "time_ms"} <= set(data.trials.columns):
        frame = best_per_shape(data.trials)
    else:
        frame = tuned_frame(data.tuned)
    if frame is None or frame.empty:
        return None
    frame = frame[frame["speedup"].notna()]
    return frame if len(frame) else None


def fla_speedups(bench: pd.DataFrame | None) -> pd.DataFrame | None:
    """The tuned config against fla's fastest mode per shape (eager rows of bench.csv), shaped like :func:`speedups`."""
    if bench is None or "speedup_vs_fla" not in bench.columns:
        return None
    tuned = bench[(bench["impl"] == "tuned") & (bench["mode"] == "eager") & bench["speedup_vs_fla"].notna()]
    if tuned.empty:
        return None
    frame = tuned.rename(columns={"speedup_vs_fla": "speedup", "median_ms": "best_ms"})
    return frame[["kernel", "dtype", *SHAPE_COLS, "speedup", "best_ms"]].reset_index(drop=True)


def speedup_vs_seq_len(frame: pd.DataFrame) -> pd.DataFrame:
    """Speedup against T, one line per (kernel, dtype, head dim K): median over batch and heads, sorted by T."""
    keys = ["kernel", "dtype", "K", "T"]
    out = frame.groupby(keys, as_index=False).agg(speedup=("speedup", "median"), best_ms=("best_ms", "median"))
    out["line"] = out["kernel"] + " D" + out["K"].astype(int).astype(str)
    return out.sort_values(["kernel", "K", "T"]).reset_index(drop=True)


def speedup_vs_head_dim(frame: pd.DataFrame) -> pd.DataFrame:
    """Speedup against head dim K, one line per (kernel, dtype, T): median over batch and heads, sorted by K."""
    keys = ["kernel", "dtype", "T", "K"]
    out = frame.groupby(keys, as_index=False).agg(speedup=("speedup", "median"), best_ms=("best_ms", "median"))
    out["line"] = out["kernel"] + " T" + out["T"].astype(int).astype(str)
    return out.sort_values(["kernel", "T", "K"]).reset_index(drop=True)


# --------------------------------------------------------------------------------------------- bench, profile


def bench_times(bench: pd.DataFrame) -> pd.DataFrame:
    """Median ms per (shape, implementation, mode) with both speedups; timed rows only, in shape order."""
    frame = bench[bench["median_ms"].notna()].copy()
    frame["shape"] = frame.apply(shape_label, axis=1)
    frame["series"] = frame["impl"].where(frame["mode"] == "eager", frame["impl"] + " (" + frame["mode"] + ")")
    frame = frame.sort_values(["kernel", "K", "T", "B", "H"], kind="stable")
    cols = [
        "kernel",
        "shape",
        "T",
        "K",
        "series",
        "impl",
        "mode",
        "median_ms",
        "speedup_vs_default",
        "speedup_vs_fla",
    ]
    cols += [c for c in ("gbs", "tflops", "first_call_s", "error_o") if c in frame.columns] + ["meaningful"]
    return frame[cols].reset_index(drop=True)


def stage_breakdown(profile: pd.DataFrame) -> pd.DataFrame:
    """Per-stage ms and share of the summed stages, per profiled shape (the whole-op row left out)."""
    frame = profile[profile["stage"] != PROFILE_TOTAL].copy()
    frame["shape"] = frame["kernel"] + " " + frame.apply(shape_label, axis=1)
    total = frame.groupby("shape")["median_ms"].transform("sum")
    frame["share"] = frame["median_ms"] / total
    cols = ["shape", "stage", "median_ms", "share", "registers", "spills", "shared_mem", "x_floor", "verdict"]
    cols = [c for c in cols if c in frame.columns]
    return frame[cols].reset_index(drop=True)


def roofline_points(bench: pd.DataFrame | None, profile: pd.DataFrame | None) -> pd.DataFrame | None:
    """Achieved TFLOP/s against arithmetic intensity (FLOP/byte) for every bench row and profiled stage."""
    parts = []
    if bench is not None and {"flops", "bytes", "tflops"} <= set(bench.columns):
        b = bench[bench["tflops"].notna() & (bench["tflops"] > 0)].copy()
        if len(b):
            b["label"] = b["impl"] + " " + b.apply(shape_label, axis=1) + " " + b["mode"]
            b["group"] = "bench: " + b["impl"]
            parts.append(b)
    if profile is not None and {"flops", "bytes", "tflops"} <= set(profile.columns):
        p = profile[profile["tflops"].notna() & (profile["tflops"] > 0)].copy()
        if len(p):
            p["label"] = p["stage"] + " " + p.apply(shape_label, axis=1)
            p["group"] = "profile: " + p["stage"]
            parts.append(p)
    if not parts:
        return None
    frame = pd.concat(parts, ignore_index=True)
    frame["intensity"] = frame["flops"] / frame["bytes"]
    return frame[["group", "label", "intensity", "tflops", "flops", "bytes"]].reset_index(drop=True)


def roofs(data: RunData) -> list[Roofs]:
    """The roofs to draw: the GPU profile's (nominal) and any measured in a profile run."""
    out = []
    gpu = data.run.get("gpu") or {}
    if gpu.get("hbm_gbs") and gpu.get("bf16_tflops"):
        out.append(Roofs.from_profile(gpu))
    p = data.profile
    if p is not None and {"roof_gbs", "roof_tflops"} <= set(p.columns):
        m = p[p["roof_gbs"].notna() & p["roof_tflops"].notna()]
        if len(m):
            out.append(
                Roofs(float(m["roof_gbs"].iloc[0]), float(m["roof_tflops"].iloc[0]), str(m["roof_source"].iloc[0]))
            )
    return out


def roof_lines(roof_list: list[Roofs], lo: float, hi: float) -> pd.DataFrame:
    """Points of each roof (memory slope up to the ridge, then flat) from intensity ``lo`` to ``hi``."""
    rows = []
    for r in roof_list:
        xs = sorted({lo, min(max(r.ridge, lo), hi), hi})
        for x in xs:
            rows.append(
                {
                    "roof": f"{r.source}: {r.gbs:.0f} GB/s, {r.tflops:.0f} TFLOP/s",
                    "intensity": x,
                    "tflops": r.attainable_tflops(x),
                }
            )
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------- the search


def search_history(trials: pd.DataFrame) -> pd.DataFrame:
    """Per study, its complete trials in order with the best time so far (the search's progress)."""
    done = trials[(trials["state"] == "complete") & trials["time_ms"].notna()]
    done = done.sort_values(["study", "number"])
    out = done[["study", "number", "time_ms"]].copy()
    out["best_so_far"] = out.groupby("study")["time_ms"].cummin()
    return out.reset_index(drop=True)


def failures_by_reason(trials: pd.DataFrame) -> pd.DataFrame:
    """How many trials were lost, by state and reason (constraint, compile, resources, gate, timeout, ...)."""
    lost = trials[trials["state"] != "complete"]
    if lost.empty:
        return pd.DataFrame(columns=["state", "reason", "count"])
    out = lost.groupby(["state", "reason"], as_index=False).size().rename(columns={"size": "count"})
    return out.sort_values(["count", "state", "reason"], ascending=[False, True, True]).reset_index(drop=True)


TRIAL_COLUMNS = [
    "study",
    "number",
    "state",
    "reason",
    "time_ms",
    "default_time_ms",
    *MEASURED[1:],
    "is_default",
    "duration_s",
    "message",
]


def trial_table(trials: pd.DataFrame) -> pd.DataFrame:
    """The full trial table: identifying columns, the ``p.*`` parameters, then measurements; sorted by study, number."""
    front = [c for c in TRIAL_COLUMNS[:4] if c in trials.columns]
    params = _param_cols(trials)
    rest = [c for c in TRIAL_COLUMNS[4:] if c in trials.columns]
    return trials[front + params + rest].sort_values(["study", "number"]).reset_index(drop=True)


def param_importance(study_db: Path | None, min_complete: int = 5) -> tuple[pd.DataFrame, list[str]]:
    """Optuna's parameter importance per study in ``study.db`` (fANOVA when scikit-learn is installed, else PED-ANOVA).

    Returns ``(frame with study, param, importance, evaluator; notes)``; studies with fewer than ``min_complete``
    complete trials get a "not enough trials" note instead.
    """
    empty = pd.DataFrame(columns=["study", "param", "importance", "evaluator"])
    if study_db is None:
        return empty, ["no study.db in the run folder"]
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{study_db.resolve()}"
    try:
        names = optuna.get_all_study_names(storage=storage)
    except Exception as exc:
        return empty, [f"study.db unreadable: {type(exc).__name__}: {exc}"]
    try:
        import sklearn  # noqa: F401

        evaluator: Any = optuna.importance.FanovaImportanceEvaluator(seed=0)
        ev_name = "fANOVA"
    except ImportError:
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        ev_name = "PED-ANOVA"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in names:
        study = optuna.load_study(study_name=name, storage=storage)
        n = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
        if n < min_complete:
            notes.append(f"{name}: not enough trials ({n} complete, need {min_complete})")
            continue
        try:
            imp = optuna.importance.get_param_importances(study, evaluator=evaluator)
        except Exception as exc:
            notes.append(f"{name}: importance failed ({type(exc).__name__}: {exc})")
            continue
        rows.extend({"study": name, "param": k, "importance": float(v), "evaluator": ev_name} for k, v in imp.items())
    frame = pd.DataFrame(rows) if rows else empty
    return frame, notes
