"""The report's data: run folders read into DataFrames, and one function per chart that shapes its frame.

Every function here is pure pandas (no plotting) so the numbers behind each chart are unit-tested. A run folder
(``dtune search --out DIR``) holds ``run.json``, ``study.db``, ``trials.csv`` and ``tuned.json``; ``dtune bench`` and
``dtune profile`` add ``bench.csv`` and ``profile.csv``. :func:`load_run` reads one or several folders *recursively*
(a folder of run folders and ``bench_<kernel>/bench.csv`` files is one report), so one report can
show every kernel. Anything may be missing: frames are None and the report leaves the section out.

Every source file keeps its commit: a ``commit`` column (``dtune bench`` / ``dtune profile`` write one), else the
``run.json`` beside it, else a ``provenance.json`` in a folder given to :func:`load_run`
(``{"commits": {"<glob of paths relative to that folder>": "<commit>"}, "note": "..."}``, for records made before
commits were recorded), else "not recorded".
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dtune.measure.work import Roofs
from dtune.tune.results import MEASURED

SHAPE_COLS = ["B", "T", "H", "HV", "K", "V", "N"]  # N: sequences (packed batches: B = 1, N > 1; older files: N = B)
PROFILE_TOTAL = "total (whole op)"
NOT_RECORDED = "not recorded"
FLA_NAMES = {"fla": "fla default", "fla_fast": "fla safe_gate"}  # bench impl -> how the report names fla's modes
CSV_FILES = (("trials", "trials.csv"), ("bench", "bench.csv"), ("profile", "profile.csv"))
LAUNCHES_CSV = ("launches", "launches.csv")  # dtune profile --mode fwd,fwd+bwd: every launch of a call
# The three uses the report answers for, in order: a chunk forward (prefill), a training step (bench rows of mode
# fwd+bwd: the chunk backward kernels), a fused-recurrent call (decode, T = 1; eager and CUDA-graph replays).
USES = ("prefill", "training", "decode")
USE_TITLES = {
    "prefill": "Prefill (chunk forward)",
    "training": "Training step (forward + backward)",
    "decode": "Decode (fused recurrent)",
}
USE_MISSING = {
    "prefill": "no prefill rows: `dtune bench -k chunk_kda --config FILE` times the chunk forward",
    "training": "no training-step rows (mode fwd+bwd): `dtune bench -k chunk_kda --mode fwd+bwd` times them",
    "decode": "no decode rows: `dtune bench -k fused_recurrent_kda --seq-lens 1 --batch 1,32,256 --graph` times them",
}
UNTUNED = "†"  # marks a shape whose own bucket was not tuned (its config borrowed, adjusted, or the default)


@dataclass
class Source:
    """One file the report read: what it is, where, how many rows, and the commit(s) it was made at."""

    kind: str  # trials, bench, profile, tuned, run
    path: str  # relative to the folder given
    rows: int
    commits: list[str]


@dataclass
class RunData:
    """Everything the folders hold (None where absent or unreadable), the files read, and load problems."""

    path: Path
    run: dict[str, Any] = field(default_factory=dict)  # the first run.json found (GPU profile, versions, kernel)
    trials: pd.DataFrame | None = None
    tuned: dict[str, Any] | None = None  # every tuned.json's entries, in one document
    bench: pd.DataFrame | None = None
    profile: pd.DataFrame | None = None
    launches: pd.DataFrame | None = None  # launches.csv: dtune profile --mode fwd,fwd+bwd
    study_db: Path | None = None
    problems: list[str] = field(default_factory=list)
    study_dbs: list[Path] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)  # every run.json found
    notes: list[str] = field(default_factory=list)  # provenance notes

    @property
    def name(self) -> str:
        return self.path.resolve().name


def _read_csv(path: Path, problems: list[str], label: str) -> pd.DataFrame | None:
    try:
        frame = pd.read_csv(path)
    except Exception as exc:  # a half-written or empty CSV must not break the report
        problems.append(f"{label}: {type(exc).__name__}: {exc}")
        return None
    if not len(frame):
        problems.append(f"{label}: no rows")
        return None
    return frame


def _read_json(path: Path, problems: list[str], label: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except Exception as exc:
        problems.append(f"{label}: {type(exc).__name__}: {exc}")
        return None


def _provenance(root: Path, problems: list[str]) -> tuple[dict[str, str], str]:
    path = root / "provenance.json"
    if not path.is_file():
        return {}, ""
    label = f"{_root_label(root)}/provenance.json"
    doc = _read_json(path, problems, label)
    if not isinstance(doc, dict) or not isinstance(doc.get("commits", {}), dict):
        problems.append(f"{label}: expected {{'commits': {{glob: commit}}, 'note': text}}")
        return {}, ""
    return {str(k): str(v) for k, v in doc.get("commits", {}).items()}, str(doc.get("note", ""))


def short_commit(commit: Any) -> str:
    """A full git hash as its first 7 characters; anything else unchanged."""
    text = str(commit)
    return text[:7] if re.fullmatch(r"[0-9a-f]{40}", text) else text


def _commit_for(rel: str, folder_run: dict[str, Any] | None, provenance: dict[str, str]) -> str:
    if folder_run and folder_run.get("commit"):
        return short_commit(folder_run["commit"])
    for pattern, commit in provenance.items():
        if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(str(Path(rel).parent), pattern):
            return commit
    return NOT_RECORDED


def _files(root: Path, name: str) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob(name) if p.is_file())


def _root_label(root: Path) -> str:
    """How a folder given to :func:`load_run` is named in the report: as given when relative (``reports/h200/c2``),
    else by its own name (an absolute path, e.g. a temporary folder of the machine that built the report, says
    nothing to a reader)."""
    return str(root) if not root.is_absolute() else root.name


def load_run(paths: str | Path | Sequence[str | Path]) -> RunData:
    """Read one or several folders (recursively); missing files stay None, unreadable ones are in ``problems``.
    Files are named relative to their folder (several folders: prefixed by :func:`_root_label`)."""
    roots = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    problems: list[str] = []
    data = RunData(path=roots[0] if roots else Path("."), problems=problems)
    frames: dict[str, list[pd.DataFrame]] = {"trials": [], "bench": [], "profile": [], "launches": []}
    entries: list[dict[str, Any]] = []
    for root in roots:
        provenance, note = _provenance(root, problems)
        if note:
            data.notes.append(f"{_root_label(root)}: {note}")
        prefix = "" if len(roots) == 1 else _root_label(root) + "/"
        run_jsons: dict[Path, dict[str, Any]] = {}
        for p in _files(root, "run.json"):
            label = prefix + str(p.relative_to(root))
            info = _read_json(p, problems, label)
            if isinstance(info, dict):
                run_jsons[p.parent] = info
                data.runs.append(info)
                data.sources.append(Source("run", label, 1, [_commit_for(label, info, provenance)]))
        for kind, filename in (*CSV_FILES, LAUNCHES_CSV):
            for p in _files(root, filename):
                rel = str(p.relative_to(root))
                label = prefix + rel
                frame = _read_csv(p, problems, label)
                if frame is None:
                    continue
                recorded = frame["commit"] if "commit" in frame.columns else pd.Series(dtype=object)
                fallback = _commit_for(rel, run_jsons.get(p.parent), provenance)
                frame["commit"] = recorded.fillna(fallback).map(short_commit) if len(recorded) else fallback
                frame["source"] = label
                if {"B", "T"} <= set(frame.columns) and "N" not in frame.columns:  # written before the N column
                    frame["N"] = frame["B"]
                frames[kind].append(frame)
                data.sources.append(Source(kind, label, len(frame), sorted(frame["commit"].astype(str).unique())))
        for p in _files(root, "tuned.json"):
            label = prefix + str(p.relative_to(root))
            doc = _read_json(p, problems, label)
            if isinstance(doc, dict) and isinstance(doc.get("entries"), list):
                entries += doc["entries"]
                data.sources.append(Source("tuned", label, len(doc["entries"]), []))
        data.study_dbs += _files(root, "study.db")
    data.run = data.runs[0] if data.runs else {}
    data.trials = pd.concat(frames["trials"], ignore_index=True) if frames["trials"] else None
    data.bench = pd.concat(frames["bench"], ignore_index=True) if frames["bench"] else None
    data.profile = pd.concat(frames["profile"], ignore_index=True) if frames["profile"] else None
    data.launches = pd.concat(frames["launches"], ignore_index=True) if frames["launches"] else None
    data.tuned = {"entries": entries} if entries else None
    data.study_db = data.study_dbs[0] if data.study_dbs else None
    return data


def shape_label(row: Any) -> str:
    """``B4 T1024 H16 D128`` (``K/V`` when they differ; `` HV=2H`` with grouped value heads, `` 16 packed`` for a
    packed variable-length batch of T tokens in all: :func:`variant_label`) from anything with B, T, H, K, V (HV, N
    optional)."""
    k, v = int(row["K"]), int(row["V"])
    d = f"D{k}" if k == v else f"K{k}/V{v}"
    label = f"B{int(row['B'])} T{int(row['T'])} H{int(row['H'])} {d}"
    return label + variant_label(row)


def variant_label(row: Any) -> str:
    """`` HV=2H`` for grouped value heads, `` 16 packed`` for a packed batch of 16 sequences, else empty: the parts
    of a shape that the kernel × head dim × T grid of the report does not show on its own."""
    out = ""
    H, HV = int(row["H"]), int(row.get("HV", row["H"]))
    if HV != H:
        out += f" HV={HV // H}H" if HV % H == 0 else f" HV{HV}"
    n = row.get("N")
    if n is not None and not (isinstance(n, float) and math.isnan(n)) and int(n) != int(row["B"]):
        out += f" {int(n)} packed"
    return out


def dim_label(row: Any) -> str:
    """``D128``, or ``K96/V64`` when they differ."""
    k, v = int(row["K"]), int(row["V"])
    return f"D{k}" if k == v else f"K{k}/V{v}"


# --------------------------------------------------------------------------------------------- environment


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
        if run.get(key) is not None:
            out[key.capitalize()] = str(run[key])
    if "interpret" in run:
        out["Interpreter"] = "yes — times are NOT meaningful" if run["interpret"] else "no (GPU timings)"
    if versions:
        out["Versions"] = ", ".join(f"{k} {v}" for k, v in versions.items())
    shapes = run.get("shapes") or []
    if shapes:
        out["Shapes"] = f"{len(shapes)}: " + ", ".join(str(s.get("shape_key", "?")) for s in shapes)
    return out


def sources_frame(data: RunData) -> pd.DataFrame:
    """One row per file read: kind, path, rows, and its commit(s) ("not recorded" when none is known)."""
    rows = [
        {"what": s.kind, "file": s.path, "rows": s.rows, "commit": ", ".join(s.commits) if s.commits else "–"}
        for s in data.sources
        if s.kind != "run"
    ]
    return pd.DataFrame(rows, columns=["what", "file", "rows", "commit"])


def commits(data: RunData) -> list[str]:
    """Every commit the sources were made at (recorded ones only), each once, in order of appearance."""
    seen: list[str] = []
    for s in data.sources:
        for c in s.commits:
            if c != NOT_RECORDED and c not in seen:
                seen.append(c)
    return seen


def meaningful(frame: pd.DataFrame | None) -> bool:
    """False when any row was timed under Triton's interpreter (``meaningful`` False)."""
    return frame is None or "meaningful" not in frame.columns or bool(frame["meaningful"].astype(bool).all())


# --------------------------------------------------------------------------------------------- the answer


def use_of(kernel: Any, mode: Any) -> str:
    """Which of :data:`USES` a bench row answers: a training step (mode fwd+bwd, a backward kernel), decode (a
    fused-recurrent kernel) or prefill (a chunk forward)."""
    k = str(kernel)
    if str(mode) == "fwd+bwd" or k.endswith("_bwd"):
        return "training"
    return "decode" if k.startswith("fused_recurrent") else "prefill"


def _lookup_bucket(row: Any) -> tuple[int, int, int]:
    """``(T, B, H)`` a row's shape is looked up by: a packed batch by its mean length and number of sequences."""
    B, T, H = int(row["B"]), int(row["T"]), int(row["H"])
    n = row.get("N")
    if n is not None and not (isinstance(n, float) and math.isnan(n)) and int(n) != B:
        return max(1, T // int(n)), int(n), H
    return T, B, H


def config_match(row: Any) -> str:
    """How the tuned row's config matched its shape: ``exact`` (its own tuned bucket), ``borrowed`` (built from other
    buckets), ``default`` or ``given``; "" when unknown. From bench.csv's ``config_match`` column, else its
    ``config_source`` (``exact: …``, ``borrowed: …``; written before: ``h200.json: T=4096 B=8 H=16``, the bucket the
    lookup took, compared with the row's own)."""
    from dtune.measure.configs import MATCHES
    from dtune.measure.configs import config_match as match_of

    given = row.get("config_match")
    if isinstance(given, str) and given in MATCHES:
        return given
    source = str(row.get("config_source") or "")
    found = match_of(source)
    if found:
        return found
    if source.startswith("template default"):
        return "default"
    m = re.search(r"\bT=(\d+) B=(\d+) H=(\d+)\b", source)
    if m is None:
        return ""
    return "exact" if tuple(int(x) for x in m.groups()) == _lookup_bucket(row) else "borrowed"


def versus(bench: pd.DataFrame | None) -> tuple[pd.DataFrame | None, str]:
    """dtune's tuned config against fla's fastest mode per shape (else against the template's default), from the
    timed rows of bench.csv: ``kernel, dtype, mode, B..V, N, dtune_ms, other_ms, other, ratio, use, match``
    (``ratio = other_ms / dtune_ms``: above 1, dtune is faster; ``use`` one of :data:`USES`; ``match`` the tuned
    config's :func:`config_match`). Returns the frame (None if there is nothing to compare) and what the comparison
    is against ("fla" or "default")."""
    if bench is None or not {"impl", "median_ms"} <= set(bench.columns):
        return None, ""
    if "N" not in bench.columns:  # a frame read without load_run (older bench.csv): fixed-length batches
        bench = bench.assign(N=bench["B"])
    timed = bench[bench["median_ms"].notna() & (bench["median_ms"] > 0)]
    if "mode" not in timed.columns:
        timed = timed.assign(mode="eager")
    fla = timed[timed["impl"].astype(str).isin(FLA_NAMES)]  # fla's modes (not FlashQLA: another peer)
    against = "fla" if len(fla) else "default"
    others = fla if len(fla) else timed[timed["impl"] == "default"]
    tuned = timed[timed["impl"] == "tuned"]
    if tuned.empty or others.empty:
        return None, ""
    tuned = tuned.assign(match=tuned.apply(config_match, axis=1) if len(tuned) else "")
    keys = ["kernel", "dtype", "mode", *SHAPE_COLS]
    best_other = others.sort_values("median_ms").drop_duplicates(keys)
    best_other = best_other[[*keys, "median_ms", "impl"]].rename(columns={"median_ms": "other_ms", "impl": "other"})
    cols = [*keys, "median_ms", "match"] + (["meaningful"] if "meaningful" in tuned.columns else [])
    mine = tuned.sort_values("median_ms").drop_duplicates(keys)[cols].rename(columns={"median_ms": "dtune_ms"})
    out = mine.merge(best_other, on=keys, how="inner")
    if out.empty:
        return None, ""
    out["other"] = out["other"].map(lambda s: FLA_NAMES.get(str(s), str(s)))
    out["ratio"] = out["other_ms"] / out["dtune_ms"]
    out["use"] = [use_of(k, m) for k, m in zip(out["kernel"], out["mode"])]
    if "meaningful" not in out.columns:
        out["meaningful"] = True
    return out.sort_values(["kernel", "K", "mode", "T", "B"]).reset_index(drop=True), against


def op_name(kernel: Any) -> str:
    """The op a kernel belongs to: a backward kernel's forward op (``chunk_kda_bwd`` -> ``chunk_kda``)."""
    k = str(kernel)
    return k[: -len("_bwd")] if k.endswith("_bwd") else k


def is_packed(row: Any) -> bool:
    n = row.get("N")
    return n is not None and not (isinstance(n, float) and math.isnan(n)) and int(n) != int(row["B"])


def heatmap_rows(vs: pd.DataFrame) -> pd.DataFrame:
    """``vs`` with a ``row`` label (op and head dim, grouped value heads; the batch when one row would hold several
    at one column; the mode when not eager), a ``col`` label and ``col_order`` (its place), and ``untuned``:

    * prefill: one column per sequence length (``T=4096``), then one per packed batch (``16 packed``, after the
      lengths: a packed batch is not one sequence of its total length);
    * decode: one column per batch (``B=32``);
    * training: one column per shape (``B8 T4096``)."""
    frame = vs.copy()
    frame["row"] = frame["kernel"].map(op_name) + " " + frame.apply(dim_label, axis=1)
    hv = frame.apply(lambda r: variant_label({**r.to_dict(), "N": r["B"]}), axis=1)  # grouped heads stay in the row
    frame["row"] = frame["row"] + hv
    packed = frame.apply(is_packed, axis=1)
    use = frame["use"] if "use" in frame.columns else pd.Series("prefill", index=frame.index)
    T, B = frame["T"].astype(int), frame["B"].astype(int)
    N = frame["N"].fillna(frame["B"]).astype(int) if "N" in frame.columns else B
    frame["col"] = "T=" + T.astype(str)
    frame["col_order"] = T.astype(float)
    frame.loc[packed, "col"] = N[packed].astype(str) + " packed"
    frame.loc[packed, "col_order"] = 1e12 + N[packed].astype(float)
    decode = use == "decode"
    frame.loc[decode, "col"] = "B=" + B[decode].astype(str) + T[decode].map(lambda t: "" if t == 1 else f" T={t}")
    frame.loc[decode, "col_order"] = B[decode] * 1e6 + T[decode]
    training = use == "training"
    frame.loc[training, "col"] = "B" + B[training].astype(str) + " T" + T[training].astype(str)
    frame.loc[training, "col_order"] = T[training] * 1e6 + B[training]
    clash = frame.groupby(["row", "mode", "col"])["B"].transform("nunique") > 1
    frame.loc[clash, "row"] = frame.loc[clash, "row"] + " B" + frame.loc[clash, "B"].astype(int).astype(str)
    graph = frame["mode"].isin(["graph"])
    frame.loc[graph, "row"] = frame.loc[graph, "row"] + " (graph)"
    match = frame["match"] if "match" in frame.columns else pd.Series("", index=frame.index)
    frame["untuned"] = match.isin(["borrowed", "default"])
    return frame


def headline(vs: pd.DataFrame, against: str, use: str | None = None) -> str:
    """One sentence. For one use (:data:`USES`): its title, then the geometric mean of the time ratios first (decode:
    per timing mode), how many shapes dtune wins and the range, and how many shapes ran a config of an untuned
    bucket. Without ``use``: every shape together."""
    who = "flash-linear-attention's fastest mode" if against == "fla" else "the untuned default config"
    if use is None:
        n, wins = len(vs), int((vs["ratio"] > 1.0).sum())
        geo = math.exp(vs["ratio"].map(math.log).mean())
        return (
            f"dtune (tuned configs) against {who}: faster on {wins} of {n} shape{'s' if n != 1 else ''}; time ratio "
            f"{vs['ratio'].min():.2f}× to {vs['ratio'].max():.2f}× (geometric mean {geo:.2f}×; above 1× dtune is "
            "faster)."
        )

    def part(frame: pd.DataFrame) -> str:
        n, wins = len(frame), int((frame["ratio"] > 1.0).sum())
        geo = math.exp(frame["ratio"].map(math.log).mean())
        if n == 1:
            return f"{geo:.2f}× (one shape)"
        lo, hi = frame["ratio"].min(), frame["ratio"].max()
        return f"{geo:.2f}× (geometric mean of {n} shapes; faster on {wins}, {lo:.2f}× to {hi:.2f}×)"

    modes = list(dict.fromkeys(vs["mode"]))
    if use == "decode" and len(modes) > 1:
        body = "; ".join(f"{'CUDA graphs' if m == 'graph' else m} {part(vs[vs['mode'] == m])}" for m in modes)
    else:
        body = part(vs)
    untuned = 0
    if "untuned" in vs.columns:
        untuned = len(vs[vs["untuned"]].drop_duplicates(["kernel", "dtype", *SHAPE_COLS]))
    tail = (
        f" {untuned} shape{'s' if untuned != 1 else ''} ran the config of an untuned bucket ({UNTUNED})."
        if untuned
        else ""
    )
    return f"{USE_TITLES[use]}: {body} against {who} (above 1×: dtune faster).{tail}"


def versus_table(vs: pd.DataFrame, against: str) -> pd.DataFrame:
    """The heatmaps' numbers as one table, units in the headers."""
    other = "fla fastest" if against == "fla" else "default"
    match = vs["match"] if "match" in vs.columns else pd.Series("", index=vs.index)
    out = pd.DataFrame(
        {
            "use": vs["use"] if "use" in vs.columns else "prefill",
            "kernel": vs["kernel"],
            "shape": vs.apply(shape_label, axis=1),
            "mode": vs["mode"],
            "dtune config": match.replace("", "–"),
            "dtune (ms)": vs["dtune_ms"],
            f"{other} (ms)": vs["other_ms"],
            f"{other} is": vs["other"],
            f"× ({other} ms / dtune ms)": vs["ratio"],
        }
    )
    return out.reset_index(drop=True)


# --------------------------------------------------------------------------------------------- speedup lines


def speedup_lines(bench: pd.DataFrame | None, axis: str, against: str = "fla") -> pd.DataFrame:
    """Speedup of the tuned config against fla's fastest mode (``against="fla"``) or the template's default, along
    ``axis`` ("T" or "K"): one line per kernel, mode and the other dimension (and batch, where one line would hold
    several at one point). Only lines with at least two points (a real sweep) are kept; along T, packed batches are
    left out (their T is a total of several sequences, not a length). Columns: ``line, x, speedup, dtune_ms,
    other_ms``."""
    cols = ["line", "x", "speedup", "dtune_ms", "other_ms"]
    if bench is None or "impl" not in bench.columns:
        return pd.DataFrame(columns=cols)
    source = bench if against == "fla" else bench[~bench["impl"].astype(str).str.startswith("fla")]
    vs, kind = versus(source)
    if vs is None or kind != against:
        return pd.DataFrame(columns=cols)
    frame = vs[~vs.apply(is_packed, axis=1)].copy() if axis == "T" else vs.copy()
    if frame.empty:
        return pd.DataFrame(columns=cols)
    fixed = frame.apply(dim_label, axis=1) if axis == "T" else "T" + frame["T"].astype(int).astype(str)
    frame["line"] = frame["kernel"] + " " + fixed + frame.apply(variant_label, axis=1)
    frame["x"] = frame[axis].astype(int)
    several = frame.groupby(["line", "mode", "x"])["B"].transform("nunique") > 1
    frame.loc[several, "line"] = frame.loc[several, "line"] + " B" + frame.loc[several, "B"].astype(int).astype(str)
    frame["line"] = frame["line"] + frame["mode"].map(lambda m: "" if m == "eager" else f" ({m})")
    agg = frame.groupby(["line", "x"], as_index=False).agg(
        speedup=("ratio", "median"), dtune_ms=("dtune_ms", "median"), other_ms=("other_ms", "median")
    )
    points = agg.groupby("line")["x"].transform("nunique")
    return agg[points >= 2].sort_values(["line", "x"]).reset_index(drop=True)[cols]


# --------------------------------------------------------------------------------------------- search


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
        if "commit" in grp.columns:
            rec["commit"] = ", ".join(sorted(grp["commit"].astype(str).unique()))
        rows.append(rec)
    return pd.DataFrame(rows)


def search_table(best: pd.DataFrame) -> pd.DataFrame:
    """:func:`best_per_shape` for the page: units in the headers, the config compact."""
    cols = {
        "kernel": "kernel",
        "dtype": "dtype",
        "shape": "shape",
        "best_ms": "best (ms)",
        "default_ms": "default at search time (ms)",
        "speedup": "× (default / best)",
        "error_o": "gate error (rel. RMS)",
        "complete": "complete",
        "failed": "failed",
        "pruned": "pruned",
        "commit": "commit",
    }
    frame = best.copy()
    frame["shape"] = frame.apply(shape_label, axis=1)
    return frame[[c for c in cols if c in frame.columns]].rename(columns=cols)


def best_configs(best: pd.DataFrame) -> dict[str, str]:
    """``kernel dtype shape`` -> the best config, compact (shown as a list under the search table)."""
    out: dict[str, str] = {}
    for _, r in best.iterrows():
        out[f"{r['kernel']} {r['dtype']} {shape_label(r)}"] = compact_config(r["config"]) or "– (none passed the gate)"
    return out


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
                **{c: b.get(c, math.nan) for c in SHAPE_COLS if c != "N"},
                "N": b.get("N", b.get("B", math.nan)),  # a bucket's N is its B
                "best_ms": e.get("time_ms", math.nan),
                "default_ms": e.get("default_time_ms", math.nan),
                "speedup": e.get("speedup", math.nan),
                "error_o": e.get("gate_error", math.nan),
                "config": json.dumps(e.get("config", {}), sort_keys=True),
                "complete": trials.get("complete", 0),
                "failed": trials.get("failed", 0),
                "pruned": trials.get("pruned", 0),
            }
        )
    return pd.DataFrame(rows)


def speedups(data: RunData) -> pd.DataFrame | None:
    """Best vs the default at search time, per shape: from trials.csv when present, else from tuned.json."""
    if data.trials is not None and {"state", "time_ms"} <= set(data.trials.columns):
        frame = best_per_shape(data.trials)
    else:
        frame = tuned_frame(data.tuned)
    if frame is None or frame.empty:
        return None
    frame = frame[frame["speedup"].notna()]
    return frame if len(frame) else None


def study_label(study: str) -> str:
    """``chunk_kda:h200:bf16:T4096-B8-H16-HV16-K128-V128`` -> ``chunk_kda T4096 B8 D128`` (short legend names)."""
    parts = study.split(":")
    if len(parts) < 4:
        return study
    dims = dict(re.findall(r"(HV|[A-Z])(\d+)", parts[3]))
    k = dims.get("K") or dims.get("D")
    v = dims.get("V") or k
    d = f"D{k}" if k == v else f"K{k}/V{v}"
    batch = f" B{dims['B']}" if "B" in dims else ""
    return f"{parts[0]} T{dims.get('T', '?')}{batch} {d}"


def search_history(trials: pd.DataFrame) -> pd.DataFrame:
    """Per study, its complete trials in order with the best time so far (the search's progress), also relative to
    the study's first complete trial (the template's default, which runs first): ``relative``, ``best_relative``."""
    done = trials[(trials["state"] == "complete") & trials["time_ms"].notna()]
    done = done.sort_values(["study", "number"])
    out = done[["study", "number", "time_ms"]].copy()
    out["best_so_far"] = out.groupby("study")["time_ms"].cummin()
    first = out.groupby("study")["time_ms"].transform("first")
    out["relative"] = out["time_ms"] / first
    out["best_relative"] = out["best_so_far"] / first
    out["label"] = out["study"].map(study_label)
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
    units = {"time_ms": "time (ms)", "default_time_ms": "default (ms)", "shared_mem": "shared mem (B)"}
    units |= {"gbs": "GB/s", "tflops": "TFLOP/s", "duration_s": "duration (s)", "error_o": "error o (rel. RMS)"}
    units |= {"error_s": "error state (rel. RMS)"}
    frame = trials[front + params + rest].sort_values(["study", "number"]).reset_index(drop=True)
    return frame.rename(columns=units)


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


def importance_table(frame: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """:func:`param_importance` as a table a reader can scan: per study, its ``top`` most important parameters with
    their share (``SEG_CHUNKS 0.62``), most important first."""
    rows = []
    for study, grp in frame.groupby("study", sort=True):
        best = grp.sort_values("importance", ascending=False).head(top)
        rec: dict[str, Any] = {"study": study_label(str(study))}
        for i, (param, share) in enumerate(zip(best["param"], best["importance"]), 1):
            rec[f"#{i}"] = f"{param} {share:.2f}"
        rows.append(rec)
    cols = ["study", *[f"#{i}" for i in range(1, top + 1)]]
    return pd.DataFrame(rows).reindex(columns=cols).fillna("–")


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


BENCH_UNITS = {
    "median_ms": "median (ms)",
    "speedup_vs_default": "× vs default",
    "speedup_vs_fla": "× vs fla fastest",
    "gbs": "GB/s",
    "tflops": "TFLOP/s",
    "first_call_s": "first call (s)",
    "error_o": "error (rel. RMS)",
}


def stage_breakdown(profile: pd.DataFrame) -> pd.DataFrame:
    """Per-stage ms and share of the summed stages, per profiled shape (the whole-op row left out)."""
    frame = profile[profile["stage"] != PROFILE_TOTAL].copy()
    frame["shape"] = frame["kernel"] + " " + frame.apply(shape_label, axis=1)
    total = frame.groupby("shape")["median_ms"].transform("sum")
    frame["share"] = frame["median_ms"] / total
    cols = ["shape", "stage", "median_ms", "share", "registers", "spills", "shared_mem", "x_floor", "verdict"]
    cols = [c for c in cols if c in frame.columns]
    return frame[cols].reset_index(drop=True)


def stage_floors(profile: pd.DataFrame) -> pd.DataFrame:
    """Each stage (and the whole op) against its floor: ``label, shape, stage, measured_ms, floor_ms, x_floor, bound``
    (floor NaN where no ceilings were known). Labels read ``kernel D128 T4096 · stage``."""
    frame = profile.copy()
    frame["shape"] = frame["kernel"] + " " + frame.apply(shape_label, axis=1)
    frame["label"] = frame["kernel"] + " " + frame.apply(dim_label, axis=1) + " T" + frame["T"].astype(int).astype(str)
    frame["label"] = frame["label"] + " · " + frame["stage"].astype(str)
    for col in ("floor_ms", "x_floor", "bound"):
        if col not in frame.columns:
            frame[col] = math.nan
    out = frame.rename(columns={"median_ms": "measured_ms"})
    return out[["label", "shape", "stage", "measured_ms", "floor_ms", "x_floor", "bound"]].reset_index(drop=True)


def roofline_points(bench: pd.DataFrame | None, profile: pd.DataFrame | None) -> pd.DataFrame | None:
    """Achieved TFLOP/s against arithmetic intensity (FLOP/byte) for every timed bench row and profiled stage."""
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


# --------------------------------------------------------------------------------------------- launches

LAUNCH_CALL = "(whole call)"  # dtune.measure.launches.CALL: the row of a contestant's whole call
LAUNCH_SEGMENTS = 7  # a peer's largest kernels drawn one by one; the rest as "other kernels"


def launch_label(row: Any) -> str:
    """``chunk_kda D128 B8 T4096 fwd+bwd`` (a figure's group) from a launches row."""
    return f"{row['kernel']} {dim_label(row)} B{int(row['B'])} T{int(row['T'])}{variant_label(row)} {row['mode']}"


def launch_segments(launches: pd.DataFrame) -> pd.DataFrame:
    """The bars of the per-launch chart: per figure group (kernel, head dim, shape, mode) and contestant, its time
    by segment: dtune's by stage (a stage's launches together; a launch without stage under its name), a peer's by
    kernel (its largest :data:`LAUNCH_SEGMENTS`, the rest as "other kernels"); and the whole call's median and the
    whole op's floor. Columns ``group, impl, segment, ms, call_ms, floor_ms, order``; timed rows only."""
    cols = ["group", "impl", "segment", "ms", "call_ms", "floor_ms", "order"]
    frame = launches[launches["ms"].notna()].copy()
    if frame.empty:
        return pd.DataFrame(columns=cols)
    frame["group"] = frame.apply(launch_label, axis=1)
    rows: list[dict[str, Any]] = []
    for (group, impl), grp in frame.groupby(["group", "impl"], sort=False):
        whole = grp[grp["launch"] == LAUNCH_CALL]
        call_ms = float(whole["ms"].iloc[0]) if len(whole) else math.nan
        floor_ms = float(whole["floor_ms"].iloc[0]) if len(whole) and "floor_ms" in whole else math.nan
        body = grp[grp["launch"] != LAUNCH_CALL]
        staged = body["stage"].fillna("").astype(str) if "stage" in body else pd.Series("", index=body.index)
        if (staged != "").any():
            key = staged.where(staged != "", body["launch"].astype(str))
            parts = body.assign(segment=key).groupby("segment", sort=False)["ms"].sum()
        else:
            parts = body.groupby("launch", sort=False)["ms"].sum().sort_values(ascending=False)
            if len(parts) > LAUNCH_SEGMENTS:
                rest = parts.iloc[LAUNCH_SEGMENTS:].sum()
                parts = pd.concat([parts.iloc[:LAUNCH_SEGMENTS], pd.Series({"other kernels": rest})])
        for order, (segment, ms) in enumerate(parts.items()):
            rows.append({"group": group, "impl": impl, "segment": str(segment), "ms": float(ms),
                         "call_ms": call_ms, "floor_ms": floor_ms, "order": order})  # fmt: skip
    return pd.DataFrame(rows, columns=cols)


LAUNCH_UNITS = {
    "launch": "launch",
    "count": "per call",
    "ms": "ms",
    "share": "share (%)",
    "stage": "stage",
    "stage_ms": "stage ms",
    "floor_ms": "floor ms",
    "x_floor": "× floor",
    "bound": "bound",
}


def launch_table(launches: pd.DataFrame) -> pd.DataFrame:
    """Every launch for the page: the group (kernel, head dim, shape, mode), contestant, position, then the
    launch's time, share, stage and the stage's floor (dtune), units in the headers; the whole call's rows last in
    each contestant's block."""
    frame = launches.copy()
    frame["call"] = frame.apply(launch_label, axis=1)
    frame["share"] = frame["share"] * 100
    cols = ["call", "impl", "position", *LAUNCH_UNITS, "note"]
    frame = frame[[c for c in cols if c in frame.columns]]
    return frame.rename(columns=LAUNCH_UNITS).reset_index(drop=True)
