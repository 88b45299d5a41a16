"""The resource model (dtune.tune.resource_model) against ptxas: compile random legal chunk configs for sm_90a on any
machine (no GPU: Triton ships ptxas) and compare each stage's predicted spills and shared memory with ptxas's.

Usage:  python scripts/resource_model_check.py [--kernels chunk_kda,...] [--dims 64,128] [--configs 20] [--seed 3]
Writes $OUT/resource_model_check.jsonl (one line per compiled stage) and prints the hit rate per stage kind.
Half of the configs are one to three moves from the default (what a local search visits), half fully random; all
satisfy the space's constraints at B = 8, T = 4096, H = 16 on the H200 profile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton, not the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

from dtune.kernels import KERNELS

from dtune.gpu import get_profile
from dtune.measure.sm90 import compile_sm90, ptxas_usage, stage_kernels
from dtune.shape import Shape
from dtune.tune import resource_model as rm
from dtune.tune.space import load_space


def sample(kernel: str, dim: int, n: int, rng: random.Random) -> list[dict[str, object]]:
    space, spec = load_space(kernel), KERNELS[kernel]
    shape, gpu = Shape(8, 4096, 16, 16, dim, dim), get_profile("h200").constraint_fields()
    default = spec.default_config(dim, dim)
    out: list[dict[str, object]] = []
    for _ in range(20000):
        if len(out) >= n:
            break
        if rng.random() < 0.5:
            cfg = dict(default)
            for p in rng.sample(list(space.params), rng.randint(1, 3)):
                cfg[p] = rng.choice(space.params[p])
        else:
            cfg = {**default, **{p: rng.choice(c) for p, c in space.params.items()}}
        if not space.violations(cfg, shape, gpu) and cfg not in out:
            out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="chunk_delta_rule,chunk_gated_delta_rule,chunk_kda")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--configs", type=int, default=20, help="configs per kernel and head dim")
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    log = (out_dir / "resource_model_check.jsonl").open("w")
    rng = random.Random(a.seed)
    tally: dict[str, list[int]] = {}  # stage: [spill hits, checked, smem within 2x, drops, drops that spilled]
    for kernel in a.kernels.split(","):
        gate = KERNELS[kernel].gate
        for dim in (int(d) for d in a.dims.split(",")):
            for cfg in sample(kernel, dim, a.configs, rng):
                pred = rm.chunk_prediction(gate, cfg, dim, dim, 2)
                for name, fn, ptrs, consts, warps, stages in stage_kernels(gate, "bf16", dim, dim, cfg, False):
                    if name not in pred:  # intra-exact: the guarded diagonal's second pass, not modelled
                        continue
                    ptx = compile_sm90(fn, ptrs, consts, warps, stages)
                    regs, spills = ptxas_usage(ptx.asm["ptx"])
                    smem = int(ptx.metadata.shared)
                    p = pred[name]
                    spilled = spills > rm.SPILL_BYTES
                    t = tally.setdefault(name, [0, 0, 0, 0, 0])
                    t[0] += p.spills == spilled
                    t[1] += 1
                    t[2] += smem == 0 or 0.5 <= p.shared / smem <= 2
                    t[3] += p.heavy
                    t[4] += p.heavy and spilled
                    row = {"kernel": kernel, "dim": dim, "stage": name, "config": cfg, "regs": regs}
                    row |= {"spills": spills, "smem": smem, "pred_regs": round(p.registers), "pred_smem": p.shared}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
    print(f"{'stage':<8}{'spill hits':>14}{'smem within 2x':>16}{'drops (spilled)':>18}")
    for name, (hits, n, smem_ok, drops, right) in tally.items():
        print(f"{name:<8}{hits:>6}/{n:<3} {100 * hits / n:4.0f}%{smem_ok:>10}/{n:<4}{drops:>10} ({right})")


if __name__ == "__main__":
    main()
