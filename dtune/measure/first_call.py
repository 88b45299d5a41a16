"""First-call cost: what a user pays at start-up for a new shape family, dtune (shipped configs) vs fla.

:func:`measure` runs each (kernel, implementation) in a fresh Python process with an empty Triton cache
(``TRITON_CACHE_DIR`` in a new temporary folder), so the first call includes JIT compilation and, for fla, its
run-time autotuning; dtune compiles exactly one configuration per stage. Run as ``python -m
dtune.measure.first_call KERNEL IMPL T D B`` it is that child: one JSON line of import, first-call and
second-call times. The call is the harness's (default workload). With ``interpret`` the children run under
Triton's interpreter on the CPU at a tiny shape (a dry run of the plumbing: the times mean nothing).
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
TINY = (8, 16, 2)  # T, D, B under the interpreter


def _child(kernel: str, impl: str, T: int, D: int, B: int) -> dict[str, float]:
    t0 = time.perf_counter()
    import torch

    from dtune.inputs import interpreting
    from dtune.measure.baselines import fla_function
    from dtune.measure.harness import op_run
    from dtune.shape import Shape

    cpu = interpreting()
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    dtype = torch.float32 if cpu else torch.bfloat16  # the interpreter's bf16 dots are wrong
    run = op_run(kernel, Shape(B, T, 16, 16, D, D), dtype, "cpu" if cpu else "cuda")
    sync()
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
    sync()
    t2 = time.perf_counter()
    call()
    sync()
    t3 = time.perf_counter()
    return {"import_s": t1 - t0, "first_s": t2 - t1, "second_ms": (t3 - t2) * 1e3}


def measure(
    kernels: Sequence[str], impls: Sequence[str], timeout_s: float = 300.0, interpret: bool = False
) -> list[dict[str, Any]]:
    """One row per (kernel, implementation), each measured in a fresh process with a cold Triton cache."""
    rows = []
    env = {"TRITON_INTERPRET": "1"} if interpret else {}
    for kernel in kernels:
        T, D, B = TINY if interpret else SHAPES["fused_recurrent" if kernel.startswith("fused") else "chunk"]
        for impl in impls:
            with tempfile.TemporaryDirectory() as cache:
                proc = subprocess.run(
                    [sys.executable, "-m", "dtune.measure.first_call", kernel, impl, str(T), str(D), str(B)],
                    env=child_env(None, TRITON_CACHE_DIR=cache, **env),
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
