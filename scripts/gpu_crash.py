"""The illegal memory access of chunk_kda trial 10 (H200, 2026-11-30), one factor at a time, and a compute-sanitizer
sweep of sampled configs of every chunk stage.

Usage (one CUDA GPU):  python scripts/gpu_crash.py [--budget-s 540] [--sweep-s 240] [--no-variants] [--no-sweep]
                       python scripts/gpu_crash.py --interpret      (a dry run on the CPU: tiny shapes, no sanitizer)

1. Variants (each in its own process, plainly and under ``compute-sanitizer --tool memcheck``): the crashing config
   (BT 64, BC 64, INTRA "rows", intra_BK 32, 4 warps, SAFE_DIAG; bf16, B8 T4096 H16 D128, log gates down to −5) run
   through the stage-1 kernel as it was at bce1546 (``scripts/gpu_crash_legacy.py``: the exact diagonal as a
   data-dependent branch inside the key loop), then one factor changed: mild gates (−0.5: no diagonal block is
   steep enough to take the branch), the branch forced in every chunk at a tiny size (B1 T200 H2, gates down to
   −60: the size that ran clean), SAFE_DIAG false (no branch), BC 32, 2 and 8 warps, fp32. Then the same config
   through today's library (the exact diagonal as a second launch, no branch), whole op, strong and steep gates,
   and the two DeltaNet "blocks" 8-warp trials that also crashed (2026-11-29; the search space's ``blocks_warps``
   constraint keeps them out). ``branch`` = programs (chunk × head) in which the legacy kernel takes the exact
   branch for these inputs (counted on the host).
2. Sweep: random configs of the three chunk search spaces (legal for the H200 at that shape, SEG_CHUNKS included),
   whole op under compute-sanitizer at B8 T4096 H16 D128 bf16 (and B1 T32768 H16 for segmented configs), log gates
   down to −5 with every 8th chunk steep (down to −60, so KDA's exact second pass runs too), until ``--sweep-s``.

Rows go to $OUT (default ./out) after every run: crash_variants.csv, crash_sweep.csv. The table is printed last.
``crashed``: the plain run died (illegal access, launch failure, non-finite output); ``sanitizer``: the error count
and the first error line (``Out-of-range shared or local address at chunk_intra_kernel+0x… in intra.py:263``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dtune, installed or not

from dtune.tune.sanitize import find_sanitizer, parse_sanitizer  # noqa: E402

TRIAL10: dict[str, Any] = {
    "BT": 64, "BC": 64, "INTRA": "rows", "intra_BK": 32, "intra_BV": 64, "intra_num_warps": 4, "intra_num_stages": 1,
    "SAFE_DIAG": True, "F32_DOT": "ieee", "FUSE_OUTPUT": False, "STATE_LAYOUT": "vk", "h_BV": 32, "h_num_warps": 8,
    "h_num_stages": 2, "o_BK": 32, "o_BV": 32, "o_num_warps": 4, "o_num_stages": 2,
}  # fmt: skip
BLOCKS8 = {"INTRA": "blocks", "FUSE_OUTPUT": False, "intra_BK": 64, "intra_num_warps": 8, "h_num_warps": 4}
BIG = {"B": 8, "T": 4096, "H": 16, "D": 128}
SMALL = {"B": 1, "T": 200, "H": 2, "D": 128}


def variants() -> list[dict[str, Any]]:
    """(name, impl, kernel, config, shape, dtype, gates) of each variant run."""
    base = {"impl": "legacy", "kernel": "chunk_kda", "config": TRIAL10, **BIG, "dtype": "bf16", "gate_min": -5.0}
    out = [
        {**base, "name": "trial10 (legacy)"},
        {**base, "name": "mild gates -0.5", "gate_min": -0.5},
        {**base, "name": "tiny, branch everywhere", **SMALL, "gate_min": -60.0},
        {**base, "name": "tiny, gates -5", **SMALL},
        {**base, "name": "SAFE_DIAG false", "config": {**TRIAL10, "SAFE_DIAG": False}},
        {**base, "name": "BC 32", "config": {**TRIAL10, "BC": 32}},
        {**base, "name": "2 warps", "config": {**TRIAL10, "intra_num_warps": 2}},
        {**base, "name": "8 warps", "config": {**TRIAL10, "intra_num_warps": 8}},
        {**base, "name": "fp32", "dtype": "fp32"},
        {**base, "name": "today: trial10", "impl": "current"},
        {**base, "name": "today: trial10 steep", "impl": "current", "steep": True},
        {**base, "name": "today: tiny -60", "impl": "current", **SMALL, "gate_min": -60.0},
    ]
    for name, cfg in (
        ("today: dn blocks w8 t18", {**BLOCKS8, "BT": 128, "BC": 64, "intra_BV": 32, "h_BV": 64, "o_BV": 64}),
        ("today: dn blocks w8 t20", {**BLOCKS8, "BT": 64, "BC": 16, "intra_BV": 128, "h_BV": 32, "o_BV": 32}),
    ):
        out.append({**base, "name": name, "impl": "current", "kernel": "chunk_delta_rule", "config": cfg})
    return out


# --------------------------------------------------------------------------------------------------- the child run


def child(spec: dict[str, Any]) -> None:
    """One run in this process: print one JSON line (``ok``, ``finite``, ``branch``) or raise."""
    import torch
    from dtune.kernels import KERNELS

    from dtune import ops
    from dtune.measure.inputs import make_inputs
    from dtune.shape import Gate, Shape

    dev = "cpu" if spec.get("interpret") else "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[spec["dtype"]]
    gate = Gate(KERNELS[spec["kernel"]].gate)
    B, T, H, D = spec["B"], spec["T"], spec["H"], spec["D"]
    p = Shape(B, T, H, H, D, D, B, gate)
    x = make_inputs(p, dtype=dtype, device=dev, seed=1, gate_min=spec["gate_min"])
    cfg = KERNELS[spec["kernel"]].check_config(D, D, spec["config"])
    if spec.get("steep") and x["g"] is not None:  # every 8th chunk steep: KDA's exact diagonal pass runs
        chunk = torch.arange(T, device=dev) // cfg["BT"]
        x["g"][:, (chunk % 8) == 3] *= 12.0
    branch = _branch_programs(x["g"], cfg) if gate is Gate.CHANNEL else 0
    if spec["impl"] == "legacy":
        outs = _run_legacy(x, cfg, p)
    else:
        o, s = ops.run_kernel(spec["kernel"], **x, output_final_state=True, config=cfg)
        outs = [o, s]
    if dev == "cuda":
        torch.cuda.synchronize()
    finite = all(bool(torch.isfinite(t).all()) for t in outs if t is not None)
    print(json.dumps({"ok": True, "finite": finite, "branch": branch}), flush=True)


def _branch_programs(g: Any, cfg: dict[str, Any]) -> int:
    """Programs (chunk × value head) in which the legacy kernel's key loop takes the exact diagonal branch: some row
    block and key tile whose half span around its middle row exceeds 80 nats."""
    import torch

    B, T, HV, K = g.shape
    BT, BC, BK = cfg["BT"], cfg["BC"], max(16, min(cfg["intra_BK"], K))
    NT = -(-T // BT)
    gp = torch.nn.functional.pad(g.float(), (0, 0, 0, 0, 0, NT * BT - T))  # padded rows: gate 0
    gam = gp.view(B, NT, BT // BC, BC, HV, K).cumsum(3)  # cumulative inside each row block (shift-free span)
    mid = gam[:, :, :, BC // 2]
    half = torch.maximum(gam[:, :, :, 0] - mid, mid - gam[:, :, :, -1])  # [B, NT, NB, HV, K]
    tiles = half.view(B, NT, BT // BC, HV, -1, BK).amax(-1)  # per key tile
    return int((tiles > 80.0).any(2).any(-1).sum())


def _run_legacy(x: dict[str, Any], cfg: dict[str, Any], p: Any) -> list[Any]:
    """The bce1546 stage-1 kernel on today's buffers (same layouts)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_crash_legacy as legacy
    from dtune.kernels.chunk.buffers import allocate
    from dtune.kernels.chunk.call import intra_launch_options, prepare_call

    call = prepare_call(
        x["q"], x["k"], x["v"], x["g"], x["beta"], "channel", p.K**-0.5, x["initial_state"], True, None, cfg
    )
    inter, _ = allocate(call)
    kw = intra_launch_options(call)
    legacy.chunk_intra_kernel[(call.NC, call.HV)](
        call.q, call.k, call.v, call.g, call.beta, inter.w, inter.u, inter.aqk, inter.qg, inter.kg, inter.gout,
        None, call.scale, call.T, SAFE_DIAG=bool(cfg["SAFE_DIAG"]), **kw,
    )  # fmt: skip
    return [inter.w, inter.u, inter.aqk]


# -------------------------------------------------------------------------------------------------- the parent


def run_one(spec: dict[str, Any], sanitizer: str | None, timeout: float) -> dict[str, Any]:
    """Run ``spec`` in a child process (under ``sanitizer`` if given): crashed?, the sanitizer's first error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    if sanitizer:
        cmd = [sanitizer, "--tool", "memcheck", "--print-limit", "3", "--error-exitcode", "99", *cmd]
    env = dict(os.environ)
    if spec.get("interpret"):
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else ""
        err, rc = "timeout", -9
    res = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    count, first = parse_sanitizer(out + "\n" + err)
    crash = ""
    if rc not in (0,) or not res:
        tail = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("=")][-1:]
        crash = f"rc {rc}: {tail[0][:140] if tail else ''}"
    elif not res[-1].get("finite", True):
        crash = "non-finite output"
    return {
        "crashed": bool(crash),
        "detail": crash,
        "sanitizer_errors": count if count is not None else (None if sanitizer else ""),
        "first_error": first[:220],
        "branch": res[-1].get("branch", "") if res else "",
        "seconds": round(time.monotonic() - t0, 1),
    }


def sample_configs(kernel: str, shape: dict[str, int], n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Random configs of the shipped space that pass its constraints for the H200 at ``shape``."""
    from dtune.kernels import KERNELS

    from dtune.gpu import get_profile
    from dtune.shape import Shape
    from dtune.tune.space import load_space

    space = load_space(kernel)
    gpu = get_profile("h200").constraint_fields()
    D = shape["D"]
    s = Shape(shape["B"], shape["T"], shape["H"], shape["H"], D, D)
    out: list[dict[str, Any]] = []
    for _ in range(5000):
        cfg = {name: rng.choice(values) for name, values in space.params.items()}
        full = KERNELS[kernel].check_config(D, D, cfg)
        if not space.violations(full, s, gpu):
            out.append(cfg)
            if len(out) == n:
                break
    return out


class Table:
    """Rows written to $OUT/<name> after each run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with self.path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=540.0, help="stop starting runs after this many seconds")
    ap.add_argument("--sweep-s", type=float, default=240.0, help="seconds for the sampled-config sweep")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="dry run on the CPU (tiny shapes, fp32, no sanitizer)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    t0 = time.monotonic()
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = None if a.interpret else find_sanitizer()
    print(f"compute-sanitizer: {sanitizer or 'not found (plain runs only)'}", flush=True)
    tiny = {"B": 1, "T": 40, "H": 1, "D": 16, "dtype": "fp32", "interpret": True}

    def left() -> float:
        return a.budget_s - (time.monotonic() - t0)

    var_rows = Table(out / "crash_variants.csv")
    if not a.no_variants:
        for spec in variants():
            if a.interpret:
                small_chunks = {"BT": 32, "BC": min(spec["config"].get("BC", 16), 32)}
                spec = {**spec, **tiny, "config": {**spec["config"], **small_chunks}}
            for mode in ("plain", "sanitizer") if sanitizer else ("plain",):
                if left() < 30:
                    break
                r = run_one(spec, sanitizer if mode == "sanitizer" else None, min(300.0, left()))
                var_rows.add({"variant": spec["name"], "impl": spec["impl"], "mode": mode, **r})
                print(f"  {spec['name']:28s} {mode:9s} crashed={r['crashed']} san={r['sanitizer_errors']} "
                      f"branch={r['branch']} {r['seconds']} s {r['first_error'][:90]}", flush=True)  # fmt: skip

    sweep_rows = Table(out / "crash_sweep.csv")
    if not a.no_sweep:
        rng = random.Random(a.seed)
        t_end = time.monotonic() + min(a.sweep_s, max(0.0, left() - 20))
        kernels = ["chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda"]
        shapes = [BIG, {"B": 1, "T": 32768, "H": 16, "D": 128}]
        i = 0
        while time.monotonic() < t_end - 20:
            kernel = kernels[i % 3]
            shape = shapes[(i // 3) % 2]
            i += 1
            if a.interpret:
                shape = {"B": 1, "T": 70, "H": 1, "D": 32}
            cfgs = sample_configs(kernel, shape, 1, rng)
            if not cfgs:
                continue
            spec = {"impl": "current", "kernel": kernel, "config": cfgs[0], **shape, "dtype": "bf16"}
            spec |= {"gate_min": -5.0, "steep": True, "name": f"sweep{i}"}
            if a.interpret:
                spec |= {"dtype": "fp32", "interpret": True}
            r = run_one(spec, sanitizer, min(300.0, t_end - time.monotonic() + 60))
            row = {"kernel": kernel, **{k: shape[k] for k in ("B", "T", "H", "D")}, **r, "config": json.dumps(cfgs[0])}
            sweep_rows.add(row)
            print(f"  sweep {kernel:24s} T{shape['T']:<6d} crashed={r['crashed']} san={r['sanitizer_errors']} "
                  f"{r['seconds']} s {r['first_error'][:80]}", flush=True)  # fmt: skip

    print(f"\n=== crash variants ({time.monotonic() - t0:.0f} s; {out}/crash_variants.csv) ===")
    print(f"{'variant':30s}{'impl':8s}{'mode':10s}{'crashed':8s}{'branch':>7s}{'errors':>7s}  first sanitizer error")
    for r in var_rows.rows:
        err = "" if r["sanitizer_errors"] in ("", None) else r["sanitizer_errors"]
        print(f"{r['variant']:30s}{r['impl']:8s}{r['mode']:10s}{'YES' if r['crashed'] else 'no':8s}"
              f"{r['branch']!s:>7s}{err!s:>7s}  {r['first_error'][:100] or r['detail'][:100]}")  # fmt: skip
    bad = [r for r in sweep_rows.rows if r["crashed"] or (r["sanitizer_errors"] not in ("", None, 0))]
    print(f"\n=== sanitizer sweep: {len(sweep_rows.rows)} configs, {len(bad)} with errors ({out}/crash_sweep.csv) ===")
    for r in bad:
        print(f"{r['kernel']:24s} T{r['T']:<6d} {r['first_error'][:90] or r['detail'][:90]}  {r['config']}")


if __name__ == "__main__":
    main()
