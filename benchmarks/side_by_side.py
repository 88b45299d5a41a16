"""Time every entry of a tuned-config file against fla side by side and record the medians in the entry
(``side_by_side_ms``): the measurements the fla backend's speed rule reads (dtune.integrations.fla, policy "measured").

Usage (one CUDA GPU, from the checkout's root):
    python benchmarks/side_by_side.py [--config dtune/configs/h200.json] [--kernels chunk_kda,chunk_kda_bwd,...]
                                      [--budget-s 540] [--rounds 3]
    python benchmarks/side_by_side.py --interpret      (CPU dry run on tiny made-up entries: fla needs a GPU, so none
                                                        gets times; the plumbing runs)

Per entry (the chunk ops, their training steps ``*_bwd``, the fused-recurrent decode): ``dtune bench``'s harness
(``dtune.measure.bench.run_bench``) at the entry's bucket, dtune with the entry's config and fla's op on the same
inputs, timing rounds interleaved, the default workload (initial and final state). Recorded: ``"dtune"``, and fla's
median under the name of what fla's dispatch ran (its log: ``"flash_qla"`` where FlashQLA took the call, else
``"fla"``; for KDA the faster of fla's default and ``safe_gate`` modes, so dtune is credited only where it beats both).
A contestant that cannot run (fla's Gated DeltaNet backward refuses Triton < 3.7.1 on Hopper) records no time, and the
backend then yields there (no measurement).
$OUT/<gpu>.json: the file with the times written in (merge it as the shipped file); $OUT/side_by_side.csv: every row;
a table printed last. fla autotunes on its first call per shape (~1 min each, 3 for
KDA's training step): --budget-s stops starting entries when less than --min-left-s would remain.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not
if "--interpret" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from dtune.kernels import get_kernel  # noqa: E402

from dtune.inputs import DTYPE_NAMES  # noqa: E402
from dtune.integrations import fla_check  # noqa: E402
from dtune.measure.bench import run_bench  # noqa: E402
from dtune.shape import Gate, Shape, ShapeGrid  # noqa: E402

ROUTED_OP = {"chunk_delta_rule": "chunk_delta_rule", "chunk_gated_delta_rule": "chunk_gated_delta_rule",
             "chunk_kda": "chunk_kda", "fused_recurrent_kda": "fused_recurrent_kda"}  # fmt: skip


def tiny_doc() -> dict[str, Any]:
    """The dry run's file: one tiny fp32 entry per kind of kernel (default configs)."""
    b = {"T": 20, "B": 1, "H": 1, "HV": 2, "K": 16, "V": 32}
    kernels = ["chunk_gated_delta_rule", "chunk_kda_bwd", "fused_recurrent_kda"]
    entries = [{"kernel": k, "dtype": "fp32", "bucket": dict(b, T=1 if "recurrent" in k else 20), "config": {}}
               for k in kernels]  # fmt: skip
    return {"schema": 1, "gpu": "cpu", "gpu_name": "interpreter", "created": "", "versions": {}, "entries": entries}


def measure(entry: dict[str, Any], device: torch.device, rounds: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The side-by-side medians of one entry, and the bench rows behind them."""
    spec = get_kernel(entry["kernel"])
    shape = Shape.from_dict(entry["bucket"], Gate(spec.gate))
    with fla_check.routes() as log:
        res = run_bench(spec.name, ShapeGrid(explicit=(shape,)), DTYPE_NAMES[entry["dtype"]], ("fla",),
                        config_file=entry["config"], device=device, rounds=rounds)  # fmt: skip
    rows = res.frame.to_dict("records")
    op = spec.forward_kernel
    name = fla_check.route_of(log.lines, ROUTED_OP.get(op, op))
    times: dict[str, float] = {}
    for r in rows:
        ms = float(r["median_ms"])
        if r["mode"] == "graph" or math.isnan(ms) or ms <= 0:  # NaN: it did not run
            continue
        key = "dtune" if r["impl"] == "tuned" else name
        times[key] = min(ms, times.get(key, float("inf")))
    for r in rows:
        r["recorded_as"] = "dtune" if r["impl"] == "tuned" else name
    return (times if "dtune" in times and len(times) > 1 else {}), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "dtune" / "configs" / "h200.json"), help="tuned-config file")
    ap.add_argument("--kernels", default="", help="only these kernels (comma-separated; default: every entry)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per entry (default 3)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting entries after this (default 540)")
    ap.add_argument("--min-left-s", type=float, default=60.0, help="an entry starts only with this much left")
    ap.add_argument("--interpret", action="store_true", help="CPU dry run on tiny made-up entries")
    args = ap.parse_args()
    os.environ["FLA_DTUNE"] = "0"  # fla's side is fla's own path, never the dtune backend
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.interpret else "cpu")
    doc = tiny_doc() if args.interpret else json.loads(Path(args.config).read_text())
    kernels = set(filter(None, args.kernels.split(",")))
    start = time.monotonic()
    table: list[dict[str, Any]] = []
    all_rows: list[dict[str, Any]] = []
    for e in doc["entries"]:
        if (kernels and e["kernel"] not in kernels) or get_kernel(e["kernel"]).forward_kernel not in ROUTED_OP:
            continue
        b = e["bucket"]
        label = f"{e['kernel']} {e['dtype']} B{b['B']} T{b['T']} H{b['H']} HV{b['HV']} K{b['K']} V{b['V']}"
        if args.budget_s - (time.monotonic() - start) < args.min_left_s and not args.interpret:
            table.append({"entry": label, "times": "skipped (budget)"})
            continue
        print(f"[side by side] {label}", flush=True)
        try:
            times, rows = measure(e, device, args.rounds)
        except Exception as exc:  # one entry that fails to run is a row, not the end of the run
            times, rows = {}, []
            table.append({"entry": label, "times": f"failed: {type(exc).__name__}: {exc}"[:160]})
        else:
            table.append({"entry": label, "times": json.dumps(times) if times else "not recorded (a side did not run)"})
        if times:
            e["side_by_side_ms"] = {k: round(v, 5) for k, v in times.items()}
        all_rows += [{"entry": label, **r} for r in rows]
        (out / f"{doc['gpu']}.json").write_text(json.dumps(doc, indent=2) + "\n")  # after every entry: nothing lost
        if all_rows:
            import pandas as pd

            pd.DataFrame(all_rows).to_csv(out / "side_by_side.csv", index=False)
    width = max((len(t["entry"]) for t in table), default=5)
    print(f"\n{'entry'.ljust(width)}  side_by_side_ms")
    for t in table:
        print(f"{t['entry'].ljust(width)}  {t['times']}")
    print(f"\nwrote {out / (doc['gpu'] + '.json')} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
