"""First-call cost: what a user pays at start-up for a new shape family, dtune (shipped configs) vs fla, each in a
fresh process with an empty Triton cache (dtune.measure.first_call).

Usage (on a CUDA machine):  python scripts/first_call.py [--kernels chunk_kda,fused_recurrent_kda] [--impls dtune,fla]
Prints one table (seconds for the first call, then ms for the second); CSV to $OUT/first_call.csv.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

import pandas as pd

from dtune.measure.first_call import measure


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", default="chunk_kda,chunk_gated_delta_rule,chunk_delta_rule,fused_recurrent_kda")
    ap.add_argument("--impls", default="dtune,fla")
    args = ap.parse_args()
    rows = measure(args.kernels.split(","), args.impls.split(","))
    frame = pd.DataFrame(rows)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "first_call.csv", index=False)
    print("\n=== first call with a cold Triton cache (s), second call (ms) ===")
    print(frame.to_string(index=False, float_format=lambda f: f"{f:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
