"""The model-shaped buckets of benchmarks/model_shapes.toml as a tuning plan: one `dtune search` per model,
tensor-parallel degree and kind of call, as a shell script (one search a line, each seeded from the shipped configs
by transfer, then one `dtune export` of every run).

Usage (no GPU needed to write the plan):
    python benchmarks/model_buckets.py [--gpus 0,1] [--models qwen3_next,kimi_linear] [--tp 1,8] [--scale 1.0]
        [--calls prefill,packed,train_fwd,train_bwd,decode] > m.sh
    OUT=/tmp/models bash m.sh                       (on the GPU machine; each line is resumable on its own)

Per model (heads divided by the degree; value heads as the model groups them) the searches are: prefill at B = 1 over
the TOML's sequence lengths, one packed prefill batch (cu_seqlens), the training step's forward and backward at
B * T = train_tokens, and decode (T = 1) over the TOML's batch sizes. Each job's SECONDS is its shapes times the
per-shape budget (``[budget]``, times --scale) plus a minute for compiles; the last line prints the total.
The last line exports every run into one file (``$OUT/model_tuned.json``, the fastest entry per bucket) to merge
into the shipped file, and benchmarks/side_by_side.py times them against fla for the backend's speed rule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dtune._toml import loads  # noqa: E402

OVERHEAD_S = 60
# the kinds of call, each a search per model and degree
CALLS = ("prefill", "packed", "train_fwd", "train_bwd", "decode")


def searches(model: str, m: dict[str, Any], tp: int, b: dict[str, Any], budget: dict[str, float]) -> list[tuple]:
    """(name, shapes, seconds per shape, dtune search arguments) of one model at one degree."""
    fam, H, HV, D = m["family"], m["heads"] // tp, m["v_heads"] // tp, m["head_dim"]
    if H < 1 or HV % H:
        return []
    heads = f"--heads {H} --hv-ratio {HV // H} --head-dims {D}"
    train_b = b["train_tokens"] // b["train_seq_len"]
    prefill = ",".join(map(str, b["prefill_seq_lens"]))
    packed = ",".join(map(str, b["packed_prefill"]))
    decode = "--seq-lens 1 --batch " + ",".join(map(str, b["decode_batch"]))
    fwd, bwd, dec = budget["forward_s"], budget["backward_s"], budget["decode_s"]
    tag, train = f"{model}_tp{tp}", f"--seq-lens {b['train_seq_len']} --batch {train_b}"
    return [
        (f"{tag}_prefill", len(b["prefill_seq_lens"]), fwd, f"-k chunk_{fam} {heads} --seq-lens {prefill} --batch 1"),
        (f"{tag}_packed", 1, fwd, f"-k chunk_{fam} {heads} --packed-seqs {packed}"),
        (f"{tag}_train_fwd", 1, fwd, f"-k chunk_{fam} {heads} {train}"),
        (f"{tag}_train_bwd", 1, bwd, f"-k chunk_{fam}_bwd {heads} {train}"),
        (f"{tag}_decode", len(b["decode_batch"]), dec, f"-k fused_recurrent_{fam} {heads} {decode}"),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="0", help="GPU indices the jobs are dealt to, round robin (default 0)")
    ap.add_argument("--models", default="", help="models of the TOML to include (default: all)")
    ap.add_argument("--tp", default="", help="tensor-parallel degrees (default: the TOML's)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every per-shape budget")
    ap.add_argument("--calls", default="", help=f"kinds of call to include, of {','.join(CALLS)} (default: all)")
    args = ap.parse_args()
    data = loads((ROOT / "benchmarks" / "model_shapes.toml").read_text())
    models = [m for m in data["models"] if not args.models or m in args.models.split(",")]
    degrees = [int(t) for t in args.tp.split(",")] if args.tp else data["buckets"]["tensor_parallel"]
    budget = {k: v * args.scale for k, v in data["budget"].items()}
    gpus = args.gpus.split(",")
    calls = [c for c in args.calls.split(",") if c] or list(CALLS)
    if unknown := sorted(set(calls) - set(CALLS)):
        ap.error(f"unknown --calls {', '.join(unknown)} (known: {', '.join(CALLS)})")
    print("# model-shaped buckets (benchmarks/model_shapes.toml), written by benchmarks/model_buckets.py")
    print('set -u; OUT="${OUT:-out}"')
    total, i = 0.0, 0
    for model in models:
        for tp in degrees:
            for name, n, per_shape, search in searches(model, data["models"][model], tp, data["buckets"], budget):
                if not any(name.endswith("_" + c) for c in calls):
                    continue
                secs = int(n * per_shape + OVERHEAD_S)
                device = gpus[i % len(gpus)]
                print(
                    f"python -m dtune search {search} --timeout {per_shape:g} --compile-ahead 6 --devices {device} "
                    f'-o "$OUT/runs/{name}"  # ~{secs} s'
                )
                total, i = total + secs, i + 1
    print('python -m dtune export "$OUT"/runs/*/ -o "$OUT/model_tuned.json"')
    print(f"# {i} searches, {total / 60:.0f} GPU-minutes in all ({total / 60 / len(gpus):.0f} per GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
