"""``dtune verify``: a correctness sweep of the ops against the float64 reference, at real sizes on a GPU.

Each :class:`Case` runs one op (a kernel with a config, on a shape, packed sequences or not, with an initial and
a final state) on the harness's random inputs (:func:`dtune.measure.inputs.make_inputs`, strong decays) and
compares output and final state with the float64 chunked reference by the one error metric
(:func:`dtune.measure.error.rel_rms_error`), against the tolerance the correctness gate applies to that kernel and
dtype (the search space's ``[tolerance]``). Optionally a second run must be bitwise identical (races).

:func:`default_cases` are the real-size cases on a GPU (grouped value heads, K != V, odd lengths, T = 1, packed batches
with an empty sequence, D = 256, KDA with log gates down to −60, the chunk variants); under the interpreter the
same kinds of cases at tiny sizes. :func:`sweep_cases` draws random configs from a search space (its constraints
applied). :func:`run_isolated` runs each case in its own process (an illegal memory access poisons the CUDA context
of the process that hit it). Run as ``python -m dtune.measure.verify CASE_JSON`` it checks one case and prints
its row as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from dtune._env import child_env
from dtune.inputs import dtype_from_name
from dtune.kernels import KERNELS, get_kernel
from dtune.measure.error import rel_rms_error
from dtune.measure.inputs import GATE_MIN, make_inputs
from dtune.shape import Gate, Shape

CHUNK = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_kda")
RECURRENT = ("fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda")
SHORT = {"none": "dn", "scalar": "gdn", "channel": "kda"}
H200_LIMITS = {"smem_per_block": 232448, "sm_count": 132, "cc_major": 9, "cc_minor": 0, "regs_per_sm": 65536}
ROW_COLUMNS = ["case", "kernel", "dtype", "config", "err_o", "err_s", "tolerance", "deterministic", "pass", "seconds"]


@dataclass(frozen=True)
class Case:
    """One checked call."""

    name: str
    kernel: str
    shape: Shape  # B, T are ignored with seq_lens (packed: B = 1, T = their sum)
    dtype: str = "bf16"
    seq_lens: tuple[int, ...] | None = None
    config: dict[str, Any] | None = None
    gate_min: float = GATE_MIN
    determinism: bool = False  # also run twice: the two results must be bitwise identical

    def as_json(self) -> str:
        d = dataclasses.asdict(self)
        d["shape"] = {**self.shape.bucket(), "N": self.shape.N}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Case:
        d = json.loads(text)
        gate = Gate(get_kernel(d["kernel"]).gate)
        seq = tuple(d["seq_lens"]) if d.get("seq_lens") is not None else None
        return cls(**{**d, "shape": Shape.from_dict(d["shape"], gate), "seq_lens": seq})


@cache
def tolerance(kernel: str, dtype: str) -> float:
    """The correctness gate's tolerance for ``kernel`` and ``dtype`` (its shipped search space)."""
    from dtune.tune.space import load_space

    return load_space(kernel).tolerance[dtype]


def check(case: Case, device: torch.device | str) -> dict[str, Any]:
    """Run one case; its row (``pass`` False with ``error`` when it raised)."""
    from dtune.kernels.reference import chunk_reference
    from dtune.ops import run_kernel

    tol = tolerance(case.kernel, case.dtype)
    row: dict[str, Any] = {"case": case.name, "kernel": case.kernel, "dtype": case.dtype}
    row |= {"config": json.dumps(case.config or {}), "tolerance": tol, "deterministic": None}
    t0 = time.perf_counter()
    try:
        dt = dtype_from_name(case.dtype)
        shape = dataclasses.replace(case.shape, gate=Gate(get_kernel(case.kernel).gate))
        x = make_inputs(shape, dt, device, seed=1, gate_min=case.gate_min, seq_lens=case.seq_lens)
        o, s = run_kernel(case.kernel, **x, output_final_state=True, config=case.config)
        o_ref, s_ref = chunk_reference(**x, output_final_state=True)
        assert s is not None and s_ref is not None
        row["err_o"], row["err_s"] = rel_rms_error(o, o_ref), rel_rms_error(s, s_ref)
        row["pass"] = row["err_o"] <= tol and row["err_s"] <= tol
        if case.determinism:
            o2, s2 = run_kernel(case.kernel, **x, output_final_state=True, config=case.config)
            row["deterministic"] = bool(torch.equal(o, o2) and s2 is not None and torch.equal(s, s2))
            row["pass"] = row["pass"] and row["deterministic"]
    except Exception as exc:  # one failing case must not hide the others
        row |= {"err_o": float("nan"), "err_s": float("nan"), "pass": False, "error": repr(exc)[:300]}
        traceback.print_exc()
    row["seconds"] = time.perf_counter() - t0
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return row


def describe(row: dict[str, Any]) -> str:
    """One line of a row, for progress output."""
    verdict = "PASS" if row["pass"] else "FAIL " + row.get("error", "")
    nan = float("nan")
    errors = f"o {row.get('err_o', nan):.2e} S {row.get('err_s', nan):.2e} (tol {row.get('tolerance', nan):.0e})"
    return f"{row['case']:<48} {row['dtype']:<5} {errors} {verdict} ({row.get('seconds', nan):.1f} s)"[:400]


def run_cases(
    cases: Iterable[Case], device: torch.device | str, on_row: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Check every case in this process, in order."""
    rows = []
    for case in cases:
        rows.append(check(case, device))
        if on_row:
            on_row(rows[-1])
    return rows


def run_isolated(cases: Sequence[Case], timeout_s: float, parallel: bool = True) -> list[dict[str, Any]]:
    """Check each case in its own process (all at once when ``parallel``, so their compiles overlap); a process
    that dies or overruns ``timeout_s`` gives a failed row naming why."""

    def start(case: Case) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "dtune.measure.verify", case.as_json()]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())

    t0 = time.monotonic()
    procs: list[tuple[Case, subprocess.Popen[str] | None]] = [(c, start(c) if parallel else None) for c in cases]
    rows = []
    for case, proc in procs:
        proc = proc or start(case)
        base = {"case": case.name, "kernel": case.kernel, "dtype": case.dtype, "config": json.dumps(case.config or {})}
        try:
            out, err = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append(base | {"pass": False, "error": "timeout"})
            continue
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if found:
            rows.append(found[-1])
        else:
            tail = err.strip().splitlines()[-1:] if err.strip() else []
            rows.append(base | {"pass": False, "error": f"crash (exit {proc.returncode}): {' '.join(tail)}"[:300]})
    return rows


# --------------------------------------------------------------------------------------------- the cases


def _gate_of(kernel: str) -> Gate:
    return Gate(get_kernel(kernel).gate)


def recurrent_cases(kernel: str, on_gpu: bool, quick: bool = False) -> list[Case]:
    """Decode at B = 256 and D = 256, a prompt, grouped value heads with K != V, a packed batch."""
    g = _gate_of(kernel)
    s = SHORT[g.value]
    shapes: list[tuple[str, Shape, tuple[int, ...] | None]]
    if on_gpu:
        shapes = [
            (f"decode-B256-H16-D128-{s}", Shape(256, 1, 16, 16, 128, 128, gate=g), None),
            (f"decode-B32-H8-D256-{s}", Shape(32, 1, 8, 8, 256, 256, gate=g), None),
            (f"prompt-B4-T4096-H16-D64-{s}", Shape(4, 4096, 16, 16, 64, 64, gate=g), None),
            (f"gva-B2-T1023-H4-HV8-K128-V64-{s}", Shape(2, 1023, 4, 8, 128, 64, gate=g), None),
            (f"varlen-H4-D128-{s}", Shape(1, 0, 4, 4, 128, 128, gate=g), (1, 700, 33, 1, 2048, 129)),
        ]
    else:
        shapes = [
            (f"decode-B3-H2-D16-{s}", Shape(3, 1, 2, 2, 16, 16, gate=g), None),
            (f"gva-B2-T37-H1-HV2-K32-V16-{s}", Shape(2, 37, 1, 2, 32, 16, gate=g), None),
            (f"varlen-H1-D16-{s}", Shape(1, 0, 1, 1, 16, 16, gate=g), (1, 20, 0, 9)),
        ]
    shapes = shapes[:2] if quick else shapes
    return [Case(name, kernel, p, dtype, lens) for name, p, lens in shapes for dtype in ("fp32", "bf16")]


def chunk_cases(kernel: str, on_gpu: bool, quick: bool = False) -> list[Case]:
    """Real sizes (T = 4096 and 16384), D = 256, a packed batch with grouped heads, K != V and an empty sequence,
    the transposed state pass, KDA with log gates down to −60, and (unless ``quick``) the config variants. float32
    only where it adds coverage (every float32 case with exact dots compiles for ~15 s on the H200)."""
    g = _gate_of(kernel)
    s = SHORT[g.value]
    both, bf16 = ("fp32", "bf16"), ("bf16",)
    vk = {"STATE_LAYOUT": "vk", "h_BV": 64}
    if not on_gpu:  # the interpreter: tiny shapes; bf16 dots are wrong there, fp16 stands in for them
        both, bf16 = ("fp32", "fp16"), ("fp16",)
        out = [
            Case(f"B2-T33-H1-D16-{s}", kernel, Shape(2, 33, 1, 1, 16, 16, gate=g), "fp32"),
            Case(f"varlen-H1-HV2-K32-V16-{s}", kernel, Shape(1, 0, 1, 2, 32, 16, gate=g), "fp32", (1, 37, 0, 20)),
        ]
        if not quick:
            out.append(Case(f"B1-T40-H1-D32-{s}-vk", kernel, Shape(1, 40, 1, 1, 32, 32, gate=g), "fp32", None, vk))
        return out
    varlen = Shape(1, 0, 4, 8, 128, 64, gate=g)
    lens = (1, 700, 33, 0, 2048, 129, 63)
    rows: list[tuple[str, Shape, tuple[int, ...] | None, dict[str, Any] | None, tuple[str, ...]]] = []
    if quick:
        rows.append((f"B8-T4096-H16-D128-{s}", Shape(8, 4096, 16, 16, 128, 128, gate=g), None, None, bf16))
        rows.append((f"B1-T16384-H16-D64-{s}", Shape(1, 16384, 16, 16, 64, 64, gate=g), None, None, bf16))
    else:
        rows.append((f"B2-T16384-H16-D128-{s}", Shape(2, 16384, 16, 16, 128, 128, gate=g), None, None, both))
        rows.append((f"B8-T4096-H16-D64-{s}", Shape(8, 4096, 16, 16, 64, 64, gate=g), None, None, bf16))
    rows.append((f"B4-T1023-H8-D256-{s}", Shape(4, 1023, 8, 8, 256, 256, gate=g), None, None, bf16))
    rows.append((f"varlen-H4-HV8-K128-V64-{s}", varlen, lens, None, both))
    rows.append((f"B8-T4096-H16-D128-{s}-vk", Shape(8, 4096, 16, 16, 128, 128, gate=g), None, vk, bf16))
    rows.append((f"varlen-H4-HV8-K128-V64-{s}-vk", varlen, lens, vk, both))
    out = [Case(n, kernel, p, dt, sl, cfg) for n, p, sl, cfg, dts in rows for dt in dts]
    if g is Gate.CHANNEL:  # per-step log gates down to −60: the guarded diagonal's exact second pass runs
        steep = Shape(2, 1000, 4, 8, 128, 128, gate=g)
        out += [Case(f"B2-T1000-H4-HV8-D128-{s}-gate-60", kernel, steep, dt, gate_min=-60.0) for dt in both]
    if not quick:
        variants: list[dict[str, Any]] = [{"FUSE_OUTPUT": True}, {"BT": 128, "BC": 32, "intra_num_warps": 4}]
        if g is Gate.CHANNEL:
            variants += [{"SAFE_DIAG": False, "BC": 16}, {"SAFE_DIAG": False, "BC": 32}, {"BT": 32, "BC": 16}]
        p = Shape(4, 2000, 8, 8, 128, 128, gate=g)
        for cfg in variants:
            tag = "-".join(f"{k}{v}" for k, v in cfg.items())
            out.append(Case(f"B4-T2000-H8-D128-{s}-{tag}", kernel, p, "bf16", None, cfg))
    return out


def default_cases(kernels: Sequence[str], on_gpu: bool, quick: bool = False) -> list[Case]:
    """The cases of every kernel in ``kernels`` (by family)."""
    out: list[Case] = []
    for kernel in kernels:
        family = get_kernel(kernel).family
        out += chunk_cases(kernel, on_gpu, quick) if family == "chunk" else recurrent_cases(kernel, on_gpu, quick)
    return out


def sweep_cases(
    kernel: str,
    n: int,
    shape: Shape,
    dtype: str = "bf16",
    seed: int = 0,
    limits: Mapping[str, int] = H200_LIMITS,
) -> list[Case]:
    """``n`` random configs of ``kernel``'s shipped search space that satisfy its constraints at ``shape`` (on a
    GPU with ``limits``), each run twice and compared bitwise."""
    from dtune.tune.space import load_space

    space = load_space(kernel)
    spec = KERNELS[kernel]
    rng = random.Random(seed)
    out: list[Case] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        cfg = {name: rng.choice(list(choices)) for name, choices in space.params.items()}
        if space.violations(spec.check_config(shape.K, shape.V, cfg), shape, limits):
            continue
        out.append(Case(f"sweep-{kernel}-{len(out)}", kernel, shape, dtype, None, cfg, determinism=True))
    return out


def _main(case_json: str) -> None:
    case = Case.from_json(case_json)
    from dtune.inputs import interpreting

    device = "cpu" if interpreting() or not torch.cuda.is_available() else "cuda"
    print(json.dumps(check(case, device)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
