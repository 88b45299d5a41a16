"""First-call cost: what a user pays at start-up for a new shape family, dtune (shipped configs) vs fla, each in a
fresh process with an empty Triton cache (dtune.measure.first_call: import, first call with its compiles and fla's
autotuning, second call).

Usage (one CUDA GPU, from the checkout's root; about 3 minutes):
    python benchmarks/first_call.py [--kernels chunk_kda,fused_recurrent_kda] [--impls dtune,fla]
    python benchmarks/first_call.py --interpret     (CPU, Triton's interpreter, tiny shapes: a dry run)
Shapes: chunk ops B8 T4096 H16 D128, fused-recurrent decode B32 T1 H16 D128, bf16. Writes $OUT/first_call.csv
(default ./out) and prints one table (seconds for the first call, then ms for the second).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="chunk_kda,chunk_gated_delta_rule,chunk_delta_rule,fused_recurrent_kda")
    ap.add_argument("--impls", default="dtune,fla", help="dtune, fla")
    ap.add_argument("--interpret", action="store_true", help="CPU, Triton's interpreter, tiny shapes (a dry run)")
    args = ap.parse_args()
    import pandas as pd

    from dtune.measure.first_call import measure

    impls = [i for i in args.impls.split(",") if not (args.interpret and i == "fla")]  # fla needs a GPU
    frame = pd.DataFrame(measure(args.kernels.split(","), impls, interpret=args.interpret))
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "first_call.csv", index=False)
    print("\n=== first call with a cold Triton cache (s), second call (ms) ===")
    print(frame.to_string(index=False, float_format=lambda f: f"{f:.3f}"))
    return 1 if "error" in frame.columns and frame["error"].notna().any() else 0


if __name__ == "__main__":
    raise SystemExit(main())
