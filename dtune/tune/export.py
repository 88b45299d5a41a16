"""``dtune export``: the best gate-passing config of every study of a run, as tuned-config JSON.

Schema 1::

    {"schema": 1, "gpu": "h200", "gpu_name": "...", "created": "...",
     "versions": {"dtune", "torch", "triton", "optuna", "python"},
     "entries": [{"kernel", "dtype", "bucket": {"T", "B", "H", "HV", "K", "V"}, "config": {...},
                  "time_ms", "default_time_ms", "speedup", "gate_error",
                  "trials": {"complete", "failed", "pruned"}, "measured_by"}]}

Only COMPLETE trials that passed the gate are candidates (:func:`dtune.results.passed`); a study without
one contributes no entry, so a config that failed can never be exported.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import optuna
from dtune.kernels import get_kernel

from dtune.shape import Shape
from dtune.tune import results
from dtune.tune.runinfo import TUNED_JSON, now_iso, read_run_json
from dtune.tune.storage import default_storage_url, open_storage, study_name

SCHEMA = 1


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def build_export(run_dir: Path) -> dict[str, Any]:
    """The tuned-config document of the run in ``run_dir`` (ValueError if it is not a run folder)."""
    info = read_run_json(run_dir)
    gpu = info["gpu"]
    url = info.get("storage") or default_storage_url(run_dir)
    storage = open_storage(url)
    names = {s.study_name for s in storage.get_all_studies()}
    optuna.logging.set_verbosity(logging.ERROR)
    entries = []
    for shape in info["shapes"]:
        name = study_name(info["kernel"], gpu["key"], info["dtype"], shape["shape_key"])
        if name not in names:
            continue
        study = optuna.load_study(study_name=name, storage=storage, sampler=optuna.samplers.RandomSampler())
        trials = study.get_trials(deepcopy=False)
        best = results.best_trial(trials)
        if best is None:
            continue
        config = dict(best.user_attrs.get("config") or best.params)
        get_kernel(info["kernel"]).check_config(shape["K"], shape["V"], config)  # never export an illegal config
        base = results.default_trial(trials)
        default_ms = base.value if base is not None and results.passed(base) else None
        errors = [_finite(best.user_attrs.get(k)) for k in ("error_o", "error_s")]
        entries.append(
            {
                "kernel": info["kernel"],
                "dtype": info["dtype"],
                "bucket": {k: shape[k] for k in ("T", "B", "H", "HV", "K", "V")},
                "config": config,
                "time_ms": best.value,
                "default_time_ms": default_ms,
                "speedup": (default_ms / best.value) if default_ms and best.value else None,
                "gate_error": max((e for e in errors if e is not None), default=None),
                "trials": results.counts(trials),
                "measured_by": measured_by(info),
            }
        )
    return {
        "schema": SCHEMA,
        "gpu": gpu["key"],
        "gpu_name": gpu.get("name", gpu["key"]),
        "created": now_iso(),
        "versions": info.get("versions", {}),
        "entries": entries,
    }


def measured_by(info: dict[str, Any]) -> str:
    """How a run's entries were measured, from its ``run.json``: the command, the GPU as torch named it, the commit and
    the day, e.g. ``dtune search -k chunk_kda --timeout 300 (NVIDIA H100 80GB HBM3, commit 2d7cbf2, 2026-12-07)``."""
    what = info.get("command") or f"dtune search -k {info['kernel']}"
    where = info.get("device_name") or info.get("gpu", {}).get("name") or ""
    commit = str(info.get("commit") or "")[:7]
    parts = [where, f"commit {commit}" if commit else "", str(info.get("created") or "")[:10]]
    if info.get("interpret"):
        parts.insert(0, "Triton's interpreter")
    return f"{what} ({', '.join(p for p in parts if p)})"


def merge_exports(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One document of several runs' exports (same GPU): per (kernel, dtype, bucket) the fastest entry."""
    gpus = {d["gpu"] for d in docs}
    if len(gpus) != 1:
        raise ValueError(
            f"cannot merge runs of different GPUs ({', '.join(sorted(gpus))}): configs must keep their GPU"
        )
    best: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for e in doc["entries"]:
            key = _key(e)
            if key not in best or e["time_ms"] < best[key]["time_ms"]:
                best[key] = e
    return {**docs[-1], "created": now_iso(), "entries": list(best.values())}


def supersede(
    shipped: dict[str, Any], newer: list[dict[str, Any]], note: str = "", max_slowdown: float | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``shipped`` with the entries of ``newer`` exports (in order) replacing its entries of the same (kernel,
    dtype, bucket), and one line per entry added, replaced or kept.

    Unlike :func:`merge_exports` (fastest wins, for the runs of one job), a newer job supersedes an older one: its
    search timed the old best config too (the template's default or a seed, or transferred), and times of different
    jobs (machines, drivers, code) are not comparable. Entries without a time are skipped; every document must be of
    ``shipped``'s GPU. ``max_slowdown``: a newer entry more than this many times slower than the one it would
    replace does not replace it (no run-to-run difference explains that much; a search that never timed the old
    config does), and its line says so.
    """
    entries = {_key(e): e for e in shipped["entries"]}
    changes = []
    for doc in newer:
        if doc["gpu"] != shipped["gpu"]:
            raise ValueError(
                f"cannot merge a {doc['gpu']} export into {shipped['gpu']} configs: configs keep their GPU"
            )
        for e in doc["entries"]:
            if e.get("time_ms") is None:
                continue
            old = entries.get(_key(e))
            line = f"{e['kernel']} {e['dtype']} {e['bucket']}: {e['time_ms']:.4g} ms"
            old_ms = old.get("time_ms") if old is not None else None
            if max_slowdown is not None and old_ms and e["time_ms"] > max_slowdown * old_ms:
                changes.append(f"{line} (kept the entry of {old_ms:.4g} ms: more than {max_slowdown:g}x slower)")
                continue
            was = "new" if old is None else f"was {old['time_ms']:.4g} ms in its own search"
            if old is not None and _same_config(old, e):
                kept = {k: old[k] for k in BENCH_FIELDS if k in old and k not in e}
                if kept:  # the same launch re-timed: its side-by-side bench still holds, and how it was made
                    e = {**e, **kept}
                    if "measured_by" in old and "measured_by" not in kept:
                        e["measured_by"] = f"{e['measured_by']}; before, the same config: {old['measured_by']}"
                        kept["measured_by"] = old["measured_by"]
                    was += f"; the same config: kept its {', '.join(kept)}"
            changes.append(f"{line} ({was})")
            entries[_key(e)] = e
    out = {**shipped, "created": now_iso(), "versions": newer[-1].get("versions", shipped.get("versions", {}))}
    if note:
        out["note"] = f"{shipped.get('note', '')}; {note}".strip("; ")
    out["entries"] = sorted(entries.values(), key=_key)
    return out, changes


# An entry's measurements made outside its search (a side-by-side bench of that config with its peers, its peak memory,
# how they were made, the time of the config it replaced there): they stay with the config, not with the search.
BENCH_FIELDS = ("side_by_side_ms", "peak_mb", "measured_by", "replaces_ms")


def _same_config(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two entries of one bucket launch the same thing: their configs equal once each is completed with the
    kernel's defaults (an entry written before a parameter existed lacks it; a newer search writes it out). A config
    the kernel refuses is compared as written."""
    if a["config"] == b["config"]:
        return True
    try:
        spec = get_kernel(a["kernel"])
        K, V = a["bucket"]["K"], a["bucket"]["V"]
        return spec.check_config(K, V, a["config"]) == spec.check_config(K, V, b["config"])
    except (ValueError, TypeError, KeyError):
        return False


# The bench's implementations that are peers of dtune in an entry's side_by_side_ms (what the fla backend's speed rule
# compares: fla's Triton path, fastest of its modes, and fla's other backends by their registry names)
PEERS = {"fla": ("fla", "fla_fast"), "flash_qla": ("flashqla",)}


def record_side_by_side(doc: dict[str, Any], frame: Any, how: str) -> tuple[dict[str, Any], list[str]]:
    """``doc`` (a tuned-config document) with ``side_by_side_ms`` from a bench of it (``frame``: the rows of
    :func:`dtune.measure.bench.run_bench`, its ``--config`` that document): for each entry whose own config the bench
    timed (a ``tuned`` row whose config is the bucket's exact entry, the entry's config as it is now where the row
    records it, meaningful, not under CUDA-graph replay; a packed batch by its lookup bucket), dtune's median and each
    peer's (:data:`PEERS`), and the step's peak memory for a backward entry; ``measured_by`` gains ``how``. One line
    per entry recorded (an earlier recording's ``how`` is replaced). Entries the bench did not time keep what they
    had."""
    rows = frame[(frame["mode"] != "graph") & frame["meaningful"].astype(bool)]
    by_key: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
    for keys, grp in rows.groupby(["kernel", "dtype", "B", "T", "H", "HV", "K", "V", "N"], dropna=False):
        kernel, dtype, B, T, H, HV, K, V, N = keys
        tuned = grp[(grp["impl"] == "tuned") & (grp["config_match"] == "exact")]
        if tuned.empty or not math.isfinite(float(tuned["median_ms"].iloc[0])):
            continue
        times = {"dtune": round(float(tuned["median_ms"].iloc[0]), 4)}
        for peer, impls in PEERS.items():
            ms = grp[grp["impl"].isin(impls)]["median_ms"].astype(float)
            ms = ms[ms.map(math.isfinite)]
            if not ms.empty:
                times[peer] = round(float(ms.min()), 4)
        if len(times) < 2:  # nothing beside dtune
            continue
        shape = Shape(int(B), int(T), int(H), int(HV), int(K), int(V), int(N), varlen=int(N) != int(B))
        key = json.dumps([kernel, dtype, shape.lookup_bucket()], sort_keys=True)
        peak = float(tuned["peak_mb"].iloc[0])
        ran = tuned["config"].iloc[0] if "config" in tuned.columns else None
        bench: dict[str, Any] = {"side_by_side_ms": times}
        if math.isfinite(peak):
            bench["peak_mb"] = round(peak, 1)
        by_key[key] = (bench, json.loads(ran) if isinstance(ran, str) and ran else None)
    entries, lines = [], []
    for e in doc["entries"]:
        hit = by_key.get(_key(e))
        if hit is None or (hit[1] is not None and not _same_config(e, {**e, "config": hit[1]})):
            entries.append(e)  # not benched, or the bench ran another config at this bucket (an older entry)
            continue
        bench = {k: v for k, v in hit[0].items() if k != "peak_mb" or get_kernel(e["kernel"]).backward}
        e = {**e, **bench, "measured_by": _with_bench(e.get("measured_by", ""), how)}
        got = bench["side_by_side_ms"]
        lines.append(
            f"{e['kernel']} {e['dtype']} {e['bucket']}: " + ", ".join(f"{k} {v:.4g} ms" for k, v in got.items())
        )
        entries.append(e)
    return {**doc, "entries": entries}, lines


def record_in_file(path: Path, frame: Any, how: str, gpu: str | None = None) -> list[str]:
    """:func:`record_side_by_side` on the tuned-config file ``path``, written back (validated, for GPU ``gpu`` when
    given) where an entry was recorded; the lines of the entries recorded."""
    doc, lines = record_side_by_side(json.loads(path.read_text(encoding="utf-8")), frame, how)
    if lines:
        write_configs(doc, path, gpu)
    return lines


def _with_bench(measured_by: str, how: str) -> str:
    """``measured_by`` with ``how`` (it starts ``side_by_side_ms:``) in place of an earlier side-by-side part."""
    if measured_by.startswith("side_by_side_ms: "):
        measured_by = ""
    head = measured_by.split("; side_by_side_ms: ")[0]
    return f"{head}; {how}" if head else how


def _key(entry: dict[str, Any]) -> str:
    return json.dumps([entry["kernel"], entry["dtype"], entry["bucket"]], sort_keys=True)


def export_document(run_dirs: Path | list[Path]) -> dict[str, Any]:
    """The export of one run folder, or the merge of several (ValueError for a folder that is not a run folder)."""
    dirs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    if not dirs:
        raise ValueError("no run folder given")
    return merge_exports([build_export(d) for d in dirs]) if len(dirs) > 1 else build_export(dirs[0])


def write_document(doc: dict[str, Any], path: Path) -> Path:
    """Write ``doc`` atomically: a reader (the ops, a search transferring from it) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def write_configs(doc: dict[str, Any], path: Path, gpu: str | None = None) -> Path:
    """Write a tuned-config file for the ops: validated as the ops validate it at run time
    (:func:`dtune.store.parse_configs`, for GPU ``gpu`` when given; a bad document raises and is never written), then
    atomically (:func:`write_document`)."""
    from dtune.store import parse_configs

    parse_configs(doc, str(path), gpu)
    return write_document(doc, path)


def write_export(run_dirs: Path | list[Path], path: Path | None = None) -> Path:
    """Write the export of one run folder, or the merge of several, to ``path``; returns the path.

    ``path`` defaults to RUN/tuned.json for one run folder and is required for several.
    """
    dirs = [run_dirs] if isinstance(run_dirs, Path) else list(run_dirs)
    if path is None and len(dirs) > 1:
        raise ValueError("merging several run folders needs an output file (-o)")
    doc = export_document(dirs)
    return write_document(doc, path or dirs[0] / TUNED_JSON)


def why_empty(run_dir: Path) -> str:
    """Why a run folder exports nothing: its trials by outcome and failure reason (from its studies)."""
    info = read_run_json(run_dir)
    storage = open_storage(info.get("storage") or default_storage_url(run_dir))
    names = {s.study_name for s in storage.get_all_studies()}
    trials: list[Any] = []
    for shape in info["shapes"]:
        name = study_name(info["kernel"], info["gpu"]["key"], info["dtype"], shape["shape_key"])
        if name in names:
            trials += optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    if not trials:
        return f"{run_dir}: no trials ran"
    c = results.counts(trials)
    reasons = ", ".join(f"{k} {v}" for k, v in results.failures_by_reason(trials).items()) or "none recorded"
    return (
        f"{run_dir}: no trial passed the gate ({c['complete']} complete, {c['failed']} failed, {c['pruned']} "
        f"pruned; failures: {reasons}; the message column of trials.csv says why)"
    )
