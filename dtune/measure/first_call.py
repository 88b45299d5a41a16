"""First-call cost: what a user pays at start-up for a new shape family, dtune (shipped configs) vs fla.

:func:`measure` runs each (kernel, implementation) in a fresh Python process with an empty Triton cache
(``TRITON_CACHE_DIR`` in a new temporary folder), so the first call includes JIT compilation and, for fla, its
run-time autotuning; dtune compiles exactly one configuration per stage. Run as ``python -m
dtune.measure.first_call KERNEL IMPL T D B`` it is that child: one JSON line of import, first-call and
second-call times. The call is the harness's (default workload).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from dtune._env import child_env

SHAPES = {"chunk": (4096, 128, 8), "fused_recurrent": (1, 128, 32)}  # T, D, B (H = 16)


def _child(kernel: str, impl: str, T: int, D: int, B: int) -> dict[str, float]:
    t0 = time.perf_counter()
    import torch

    from dtune.measure.baselines import fla_function
    from dtune.measure.harness import op_run
    from dtune.shape import Shape

    run = op_run(kernel, Shape(B, T, 16, 16, D, D), torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    call: Callable[[], Any]
    if impl == "dtune":
        call = run.call(None)
    else:
        from dtune.measure.baselines import _fla

        fn, why = fla_function(kernel)
        if fn is None:
            raise RuntimeError(why)
        call = _fla(fn, run.inputs["g"] is not None)(run.inputs)
    t1 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return {"import_s": t1 - t0, "first_s": t2 - t1, "second_ms": (t3 - t2) * 1e3}


def measure(kernels: Sequence[str], impls: Sequence[str], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """One row per (kernel, implementation), each measured in a fresh process with a cold Triton cache."""
    rows = []
    for kernel in kernels:
        T, D, B = SHAPES["fused_recurrent" if kernel.startswith("fused") else "chunk"]
        for impl in impls:
            with tempfile.TemporaryDirectory() as cache:
                proc = subprocess.run(
                    [sys.executable, "-m", "dtune.measure.first_call", kernel, impl, str(T), str(D), str(B)],
                    env=child_env(TRITON_CACHE_DIR=cache),
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                )
            row: dict[str, Any] = {"kernel": kernel, "impl": impl, "T": T, "D": D, "B": B}
            if proc.returncode == 0:
                row |= json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                row["error"] = proc.stderr.strip().splitlines()[-1][:160] if proc.stderr.strip() else "failed"
            rows.append(row)
    return rows


if __name__ == "__main__":
    k, i, t, d, b = sys.argv[1:6]
    print(json.dumps(_child(k, i, int(t), int(d), int(b))))
