"""The benchmark of record: dtune's ops as users call them (the default call, with the shipped configs or
``--config FILE``) side by side with fla on this GPU, one ``dtune bench`` / ``dtune profile`` call after another.

Usage (one CUDA GPU, from the checkout's root; about 20 minutes in all, most of it fla's first calls autotuning):
    python benchmarks/record.py --steps forward,decode   # ~7 min
    python benchmarks/record.py --steps packed,profile   # ~6 min
    python benchmarks/record.py --steps training         # ~7 min
    python benchmarks/record.py --anchors --steps forward,decode,training --budget-s 500   # the headline shapes
    python benchmarks/record.py --interpret              # every step on the CPU at tiny shapes (a dry run)

Steps (bf16, H = 16, D = 128; fla: fla-core's default mode and, for chunk_kda, its fastest, safe_gate=True,
lower_bound=-5; each call interleaves the contestants over 3 rounds, L2 flushed, and times the initial state read
and the final state written):
  forward   the chunk ops at T = 1024, 4096, 16384 with B·T = 32768 (chunk_kda also at D = 64), one prompt of 32768
            and 65536 tokens (B = 1), and grouped value heads (HV = 2H) at B = 1, T = 32768
  packed    one packed batch of 16 prompts (52640 tokens, cu_seqlens) per chunk op
  decode    the fused-recurrent ops at T = 1, B = 32 and 256: eager and CUDA-graph replays
  training  the chunk ops' training step (dtune bench --mode fwd+bwd: forward under autograd, then the gradients of
            the output and the final state), B = 8, T = 4096
  profile   per-stage times, registers and spills of the chunk ops at B = 8, T = 4096 against each stage's floor
Each call runs in a child process (a crash costs one call) with a time limit (--call-timeout). Written under $OUT
(default ./out), at most 8 files: record/<step>/bench.csv (profile: profile.csv), record/commands.json (every call:
command, exit code, seconds; kept across runs into the same folder), record/README.md (the commands and the commit)
and the report record/dtune-<gpu>-report.html (dtune report). A table of dtune against fla is printed last. With
--record-into FILE (this GPU's tuned-config file), each entry the benches ran as it is gets their medians as its
side_by_side_ms, which the fla backend's speed rule reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not

from dtune._env import child_env  # noqa: E402

CHUNK = ("chunk_kda", "chunk_gated_delta_rule", "chunk_delta_rule")
RECURRENT = ("fused_recurrent_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_delta_rule")
STEPS = ("forward", "packed", "decode", "training", "profile")
PACKED = "1024,4096,2048,6144,512,3072,8192,1536,2560,4608,896,5632,3584,1280,3328,4128"  # 16 prompts, 52640 tokens
FULL = {"T": "1024,4096,16384", "tokens": "32768", "long": "32768,65536", "one": "32768", "D": "128", "D64": "64",
        "H": "16", "packed": PACKED, "decode_B": "32,256", "step_T": "4096", "step_B": "8",
        "dtype": "bf16"}  # fmt: skip
# The README's headline shapes alone (B 8 T 4096 and B 1 T 32768; decode at B 32 and 256; the step at B 8 T 4096)
ANCHORS = {**FULL, "T": "4096", "long": "32768", "one": "", "D64": ""}
TINY = {"T": "20,40", "tokens": "80", "long": "64", "one": "64", "D": "16", "D64": "32", "H": "2",
        "packed": "5,17,40", "decode_B": "2", "step_T": "40", "step_B": "2", "dtype": "fp32"}  # fmt: skip


def calls(step: str, s: dict[str, str]) -> list[list[str]]:
    """The dtune commands (arguments after ``dtune``) of one step, at the shapes ``s``."""
    shape = ["--head-dims", s["D"], "--heads", s["H"]]
    if step == "forward":
        out = []
        for k in CHUNK:
            dims = f"{s['D64']},{s['D']}" if k == "chunk_kda" and s["D64"] else s["D"]
            out.append(["bench", "-k", k, "--seq-lens", s["T"], "--batch-tokens", s["tokens"], "--head-dims", dims,
                        "--heads", s["H"]])  # fmt: skip
            out.append(["bench", "-k", k, "--seq-lens", s["long"], "--batch", "1", *shape])
            if s["one"]:
                out.append(["bench", "-k", k, "--seq-lens", s["one"], "--batch", "1", "--hv-ratio", "2", *shape])
        return out
    if step == "packed":
        return [["bench", "-k", k, "--packed-seqs", s["packed"], *shape] for k in CHUNK]
    if step == "decode":
        return [["bench", "-k", k, "--seq-lens", "1", "--batch", s["decode_B"], "--graph", *shape] for k in RECURRENT]
    if step == "training":
        step_shape = ["--seq-lens", s["step_T"], "--batch", s["step_B"], *shape]
        return [["bench", "-k", k, "--mode", "fwd+bwd", *step_shape] for k in CHUNK]
    if step == "profile":
        return [["profile", "-k", k, "--seq-len", s["step_T"], "--batch", s["step_B"], "--head-dim", s["D"], "--heads",
                 s["H"]] for k in CHUNK]  # fmt: skip
    raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    ap.add_argument("--config", type=Path, default=None, help="a tuned-config file to bench (default: the shipped)")
    ap.add_argument("--baselines", default="fla", help="beside dtune's tuned config: fla, default, torch")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per shape (default 3; 1 on the CPU)")
    ap.add_argument("--call-timeout", type=float, default=420.0, help="seconds one dtune call may take")
    ap.add_argument("--anchors", action="store_true", help="only the headline shapes (B8 T4096, B1 T32768; decode)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no call after this many seconds")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    ap.add_argument(
        "--record-into",
        type=Path,
        default=None,
        metavar="FILE",
        help="a tuned-config file of this GPU (e.g. dtune/configs/h200.json): each entry the benches ran as it is "
        "gets their side-by-side medians (side_by_side_ms, read by the fla backend's speed rule)",
    )
    args = ap.parse_args(argv)
    unknown = [x for x in args.steps.split(",") if x not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
    return args


def command(args: argparse.Namespace, words: list[str], s: dict[str, str]) -> list[str]:
    """The whole dtune command line of one call (without --out, which the record adds)."""
    extra = ["--dtype", s["dtype"], "--rounds", str(args.rounds or (1 if args.interpret else 3))]
    if words[0] == "profile":
        extra = extra[:2]
    else:
        extra += ["--baselines", "default" if args.interpret else args.baselines]  # fla needs a GPU
    if args.config is not None:
        extra += ["--config", str(args.config)]
    return ["dtune", *words, *extra, *(["--interpret"] if args.interpret else [])]


def build_report(record: Path, gpu: str) -> None:
    """``dtune report`` of the record in a child process that sees what this one sees (PYTHONPATH kept: the report's
    charting library may be installed there)."""
    report = [sys.executable, "-m", "dtune", "report", str(record), "-o", str(record / f"dtune-{gpu}-report.html")]
    subprocess.run(report, cwd=ROOT, env=child_env(), check=False)


def run(cmd: list[str], out: Path, timeout: float) -> tuple[int, float, str]:
    """One dtune command line (``dtune ...``) in a child process running this checkout's dtune: its exit code,
    seconds and last lines."""
    env = child_env()
    if "--interpret" in cmd:
        env["TRITON_INTERPRET"] = "1"
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", *cmd, "--out", str(out)], cwd=ROOT, env={**env, "COLUMNS": "100"},
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
        code, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, text = 124, f"timed out after {timeout:.0f} s: {(e.stdout or b'')[-2000:]!r}"
    return code, time.monotonic() - t0, "\n".join(text.strip().splitlines()[-12:])


def merge(parts: list[Path], dest: Path, name: str) -> int:
    """The ``name`` CSVs of one step's calls as one file in ``dest``; its rows."""
    import pandas as pd

    frames = [pd.read_csv(p / name) for p in parts if (p / name).is_file()]
    if not frames:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    frame = pd.concat(frames, ignore_index=True)
    frame.to_csv(dest / name, index=False)
    return len(frame)


def readme(record: Path, log: list[dict[str, Any]], gpu: str) -> None:
    """README.md of the record: what was run where, and how to rebuild the report."""
    import platform

    from dtune.provenance import git_commit
    from dtune.tune.runinfo import versions

    v = versions()
    try:
        from importlib.metadata import version

        fla = f"fla-core {version('fla-core')}"
    except Exception:  # not installed: the benches have no fla rows
        fla = "no fla-core"
    lines = [
        f"# Benchmark of record: {gpu}",
        "",
        f"Commit {git_commit()}; torch {v.get('torch')}, triton {v.get('triton')}, {fla}, Python "
        f"{platform.python_version()}. Made by `benchmarks/record.py`, whose docstring says what each step measures.",
        "",
        "| step | command | exit | s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['step']} | `{r['command']}` | {r['exit']} | {r['seconds']:.0f} |" for r in log]
    lines += ["", f"The report: `dtune report {record} -o {record}/dtune-{gpu}-report.html`.", ""]
    (record / "README.md").write_text("\n".join(lines), encoding="utf-8")


def table(record: Path) -> str:
    """dtune's tuned config against fla's fastest mode per shape and mode, from the record's bench.csv files."""
    import pandas as pd

    frames = [pd.read_csv(p) for p in sorted(record.glob("*/bench.csv"))]
    if not frames:
        return "(no bench rows)"
    f = pd.concat(frames, ignore_index=True)
    f["N"] = f["N"] if "N" in f.columns else f["B"]
    keys = ["kernel", "B", "T", "H", "HV", "K", "N", "mode"]
    tuned = f[f["impl"] == "tuned"].set_index(keys)["median_ms"]
    fla = f[f["impl"].isin(["fla", "fla_fast"])].groupby(keys)["median_ms"].min()
    rows = pd.DataFrame({"dtune_ms": tuned, "fla_ms": fla.reindex(tuned.index)})
    rows["x_fla"] = rows["fla_ms"] / rows["dtune_ms"]
    return rows.reset_index().to_string(index=False, float_format=lambda x: f"{x:.4g}")


def record_into(path: Path, record: Path, args: argparse.Namespace, gpu: str) -> None:
    """Each bench step's side-by-side medians into the tuned-config file ``path``
    (:func:`dtune.tune.export.record_side_by_side`: the entries the benches ran as they are, timed meaningfully)."""
    import pandas as pd

    from dtune.provenance import stamp
    from dtune.tune.export import record_in_file

    when = stamp(f"{args.rounds or 3} interleaved rounds")
    total = 0
    for step in args.steps.split(","):
        csv = record / step / "bench.csv"
        if step == "profile" or not csv.is_file():
            continue
        how = (f"side_by_side_ms: the benchmark of record (python benchmarks/record.py --steps {step}, the default "
               f"call beside fla, {when})")  # fmt: skip
        total += len(record_in_file(path, pd.read_csv(csv), how, gpu))
    print(f"recorded side_by_side_ms of {total} entries in {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    from dtune.gpu import resolve_gpu

    gpu = resolve_gpu("auto", interpret=args.interpret).key
    if args.record_into is not None:
        from dtune.store import ConfigFileError, read_configs

        try:
            recorded_gpu = read_configs(args.record_into).gpu
        except ConfigFileError as e:
            print(f"--record-into: {e}", file=sys.stderr)
            return 2
        if recorded_gpu != gpu:
            print(f"--record-into {args.record_into}: not a tuned-config file of this GPU ({gpu})", file=sys.stderr)
            return 2
    s = TINY if args.interpret else ANCHORS if args.anchors else FULL
    start = time.monotonic()
    record = Path(os.environ.get("OUT", "out")) / "record"
    record.mkdir(parents=True, exist_ok=True)
    log_path = record / "commands.json"
    log: list[dict[str, Any]] = json.loads(log_path.read_text()) if log_path.is_file() else []
    failed = 0
    with tempfile.TemporaryDirectory(prefix="dtune_record_") as tmp:
        for step in args.steps.split(","):
            parts = []
            name = "profile.csv" if step == "profile" else "bench.csv"
            for i, words in enumerate(calls(step, s)):
                cmd = command(args, words, s)
                if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                    print(f"=== {step}: SKIP (past --budget-s): {shlex.join(cmd)}", flush=True)
                    failed += 1
                    continue
                part = Path(tmp) / f"{step}-{i}"
                print(f"=== {step}: {shlex.join(cmd)}", flush=True)
                code, seconds, tail = run(cmd, part, args.call_timeout)
                print(f"{tail}\n(exit {code}, {seconds:.0f} s)", flush=True)
                failed += code != 0
                parts.append(part)
                log = [r for r in log if r["command"] != shlex.join(cmd)]
                log.append({"step": step, "command": shlex.join(cmd), "exit": code, "seconds": seconds})
                log_path.write_text(json.dumps(log, indent=2) + "\n")
                rows = merge(parts, record / step, name)  # after every call: a time limit loses only the call it stops
            print(f"{step}: {rows if parts else 0} rows in {record / step / name}", flush=True)
    readme(record, log, gpu)
    if args.record_into is not None:
        record_into(args.record_into, record, args, gpu)
    build_report(record, gpu)
    print(f"\n=== dtune against fla's fastest mode (median ms; x_fla above 1: dtune is faster) ===\n{table(record)}")
    print(f"{failed} call(s) failed; record in {record}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
