"""Static figures of one chunk stage compiled for sm_90a (Hopper) on any machine, no GPU: tensor-core instructions,
shared-memory traffic and barriers inside the chunk loop of the PTX, and registers / spills from the ptxas that
Triton ships. The source of the "kv" vs "vk" state-pass table in reports/h200/NOTES.md.

Usage:  python scripts/sm90_stats.py [--gate scalar] [--stage state] [--dim 128] CONFIG_JSON [CONFIG_JSON ...]
e.g.    python scripts/sm90_stats.py '{}' '{"STATE_LAYOUT": "vk", "h_BV": 64}'

Run it from the checkout with the package importable (the compile helpers are the sm_90 compile test's).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

import triton
from dtune.kernels import KERNELS
from test_chunk_compile import compile_sm90, stage_kernels

OPS = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}


def loop_body(ptx: str) -> str:
    """The longest backward-branch region of the PTX (the chunk loop of the state pass; the key loop elsewhere)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L__BB\d+_\d+):", line.strip()))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    return "\n".join(lines[best[0] : best[1] + 1])


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """(registers, spill-store bytes) of the kernel, from ptxas -v for sm_90a."""
    try:  # the ptxas Triton itself uses for sm_90 (Triton >= 3.4 ships a second one for new targets)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except ImportError:  # older Triton: the one ptxas it ships
        ptxas = sorted(glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas*")))[0]
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="config overrides as JSON, on top of the kernel's default")
    ap.add_argument("--gate", choices=list(OPS), default="scalar")
    ap.add_argument("--stage", default="state", help="intra, state, output or intra-exact")
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--dtype", default="bf16")
    a = ap.parse_args()
    print(f"{OPS[a.gate]}, {a.dtype}, K = V = {a.dim}, stage {a.stage}, sm_90a, triton {triton.__version__}")
    head = f"{'config':<48}{'wgmma':>7}{'mma.sync':>9}{'st.shared':>10}{'ld.shared':>10}{'bar.sync':>9}{'regs':>6}"
    print(head + f"{'spills':>7}")
    for text in a.configs:
        cfg = KERNELS[OPS[a.gate]].check_config(a.dim, a.dim, json.loads(text))
        stages = {s[0]: s for s in stage_kernels(a.gate, a.dtype, a.dim, a.dim, cfg, False)}
        if a.stage not in stages:
            raise SystemExit(f"no stage {a.stage!r} in this config (stages: {', '.join(stages)})")
        _, fn, ptrs, consts, warps, n_stages = stages[a.stage]
        ptx = compile_sm90(fn, ptrs, consts, warps, n_stages).asm["ptx"]
        body = loop_body(ptx)
        counts = [
            len(re.findall(p, body))
            for p in (r"wgmma\.mma_async", r"\bmma\.sync", r"st\.shared|stmatrix", r"ld\.shared|ldmatrix", r"bar\.sync")
        ]
        regs, spills = ptxas_usage(ptx)
        print(f"{text:<48}" + "".join(f"{c:>{w}}" for c, w in zip(counts, (7, 9, 10, 10, 9))) + f"{regs:>6}{spills:>7}")


if __name__ == "__main__":
    main()
