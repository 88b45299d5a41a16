"""fla's ops called with and without the dtune backend on the same inputs (``benchmarks/fla_backend.py`` and the GPU
tests of ``tests/dtune/integrations``).

One :class:`Case` per option real models pass (and the layers' combinations): fla's public op is called once with
the dtune backend off (fla's own path: its Triton kernels, or FlashQLA where it is installed and takes the call) and
once on (policy ``"always"``), on the same inputs; the outputs, final states and every gradient are compared with each
other and with the float64 reference of the call with its options (:func:`dtune.kernels.reference.reference_with_
options`, chunked, float64 autograd). The route of each call is read from fla's own log (``[FLA Backend] op -> name``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

import dtune.integrations.fla as dtune_fla
from dtune.kernels.reference import reference_with_options
from dtune.measure.error import rel_rms_error

Tensor = torch.Tensor

FLOOR = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # the search spaces' gate tolerances


@dataclass(frozen=True)
class Case:
    """One call: an fla op with keyword options; ``varlen``: ``"int32"``, ``"int64"`` or ``"int32+cpu"`` offsets
    (the last with ``cu_seqlens_cpu``); ``grad``: also every gradient."""

    name: str
    op: str  # "chunk_gated_delta_rule", "chunk_kda", "fused_recurrent_kda" or "chunk_delta_rule"
    options: dict[str, Any] = field(default_factory=dict)
    varlen: str | None = None
    grad: bool = True


GATE = {"use_gate_in_kernel": True}  # A_log and dt_bias are drawn with the inputs
SIGMOID = {"use_beta_sigmoid_in_kernel": True}
LAYER_GDN = {"use_qk_l2norm_in_kernel": True, **SIGMOID, "state_v_first": True, **GATE}  # fla's GatedDeltaNet
LAYER_KDA = {**LAYER_GDN}  # fla's KimiDeltaAttention (safe_gate / lower_bound where the layer sets them)


def cases() -> list[Case]:
    """Every option on its own, then the layers' calls, per op."""
    out: list[Case] = []
    for op in ("chunk_gated_delta_rule", "chunk_kda"):
        tag = "gdn" if op == "chunk_gated_delta_rule" else "kda"
        out += [
            Case(f"{tag}-plain", op),
            Case(f"{tag}-qk-l2norm", op, {"use_qk_l2norm_in_kernel": True}),
            Case(f"{tag}-gate-in-kernel", op, dict(GATE)),
            Case(f"{tag}-beta-sigmoid", op, dict(SIGMOID)),
            Case(f"{tag}-neg-eigval", op, {**SIGMOID, "allow_neg_eigval": True}),
            Case(f"{tag}-state-v-first", op, {"state_v_first": True}),
            Case(f"{tag}-varlen-int64", op, varlen="int64"),
            Case(f"{tag}-varlen-int32-cpu", op, varlen="int32+cpu"),
            Case(f"{tag}-layer", op, dict(LAYER_GDN if tag == "gdn" else LAYER_KDA)),
        ]
    out += [
        Case("kda-gate-lower-bound", "chunk_kda", {**GATE, "lower_bound": -5.0, "safe_gate": True}),
        Case("kda-layer-varlen", "chunk_kda", {**LAYER_KDA, "lower_bound": -5.0, "safe_gate": True}, "int32+cpu"),
        Case("kda-decode-layer", "fused_recurrent_kda", {**LAYER_KDA, "lower_bound": -5.0}, grad=False),
        Case("kda-decode-plain", "fused_recurrent_kda", grad=False),
        Case("delta-plain", "chunk_delta_rule"),
        Case("delta-qk-l2norm", "chunk_delta_rule", {"use_qk_l2norm_in_kernel": True}),
    ]
    return out


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int


def seq_lens(T: int) -> list[int]:
    """The packed batch of a varlen case: three sequences (one empty, one odd) filling ``T`` tokens."""
    a = max(1, T // 3) | 1
    return [a, 0, T - a]


def make_inputs(case: Case, d: Dims, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """Random inputs of ``case`` (never zeros): raw values where an option takes raw ones (gate, beta logits, q/k before
    their norm), else what fla's layers feed (L2-normalised keys, log gates with strong decays, beta in (0, 1)); a
    float32 initial state in the option's layout; ``A_log``/``dt_bias`` drawn as fla's layers initialise them."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    o = case.options

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    B, T = (1, d.B * d.T) if case.varlen else (d.B, d.T)
    if case.op == "fused_recurrent_kda":
        T = 1  # one decode step of B sequences, each with its cached state
    N = 3 if case.varlen else B
    q, k = randn(B, T, d.H, d.K), randn(B, T, d.H, d.K)
    if not o.get("use_qk_l2norm_in_kernel"):
        q, k = q * d.K**-0.5, torch.nn.functional.normalize(k, dim=-1)
    channel = case.op in ("chunk_kda", "fused_recurrent_kda")
    gshape = (B, T, d.HV, d.K) if channel else (B, T, d.HV)
    if o.get("use_gate_in_kernel"):
        g = randn(*gshape, scale=2.0)  # the raw gate: -exp(A_log) softplus(g + dt_bias) in the op
    else:
        g = -torch.rand(*gshape, generator=gen).to(device) * 5.0  # log gates down to -5 per step
    beta = randn(B, T, d.HV, scale=2.0) if o.get("use_beta_sigmoid_in_kernel") else torch.rand(B, T, d.HV).to(device)
    h0 = randn(N, d.HV, d.V, d.K) if o.get("state_v_first") else randn(N, d.HV, d.K, d.V)
    dt = torch.exp(torch.rand(d.HV * d.K if channel else d.HV, generator=gen) * (math.log(0.1) - math.log(1e-3)))
    dt = (dt * 1e-3).clamp(min=1e-4)
    x: dict[str, Any] = {
        "q": q.to(dtype),
        "k": k.to(dtype),
        "v": randn(B, T, d.HV, d.V).to(dtype),
        "g": g if not o.get("use_gate_in_kernel") else g.to(dtype),
        "beta": beta.to(dtype) if o.get("use_beta_sigmoid_in_kernel") else beta,
        "initial_state": h0 * 0.1,
        "A_log": torch.log(torch.empty(d.HV).uniform_(1, 16, generator=gen)).to(device),
        "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(device),
        "cu_seqlens": None,
        "cu_seqlens_cpu": None,
    }
    if case.op == "chunk_delta_rule":
        x["g"] = None
    if case.varlen:
        offs = torch.tensor([0, *torch.tensor(seq_lens(T)).cumsum(0).tolist()])
        x["cu_seqlens"] = offs.to(device, torch.int64 if case.varlen == "int64" else torch.int32)
        if case.varlen.endswith("+cpu"):
            x["cu_seqlens_cpu"] = offs
    return x


def leaves(case: Case, x: dict[str, Any]) -> list[str]:
    """The inputs a gradient is taken of (the call's tensors that a model would train)."""
    names = ["q", "k", "v", "beta", "initial_state"] + ([] if x["g"] is None else ["g"])
    if case.options.get("use_gate_in_kernel"):
        names += ["A_log", "dt_bias"]
    return names


def call_fla(case: Case, x: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """fla's public op (through fla's dispatch) on ``x``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    o = dict(case.options)
    gate = {"A_log": x["A_log"], "dt_bias": x["dt_bias"]} if o.get("use_gate_in_kernel") else {}
    common = {"initial_state": x["initial_state"], "output_final_state": True, "cu_seqlens": x["cu_seqlens"]}
    if case.op == "fused_recurrent_kda":
        o.pop("safe_gate", None)
        return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **gate, **common, **o)
    common["cu_seqlens_cpu"] = x["cu_seqlens_cpu"]
    if case.op == "chunk_delta_rule":
        out = dtune_fla.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], **common, **o)
    elif case.op == "chunk_kda":
        out = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **gate, **common, **o)
    else:
        out = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], **gate, **common, **o)
    return out[0], out[1]


def call_reference(case: Case, x: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """The float64 reference of the same call (chunked form; the options as fla defines them)."""
    o = {n: v for n, v in case.options.items() if n != "safe_gate"}
    gate = {"A_log": x["A_log"], "dt_bias": x["dt_bias"]} if o.get("use_gate_in_kernel") else {}
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, x["cu_seqlens"])
    return reference_with_options(*args, **gate, **o, chunked=True)


class RouteLog(logging.Handler):
    """fla's dispatch log lines (``[FLA Backend] op.fn -> backend``), as fla writes them once per process and key."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def routes() -> Iterator[RouteLog]:
    """Capture fla's routing log; its once-per-process memory is cleared first, so every call logs its route."""
    import fla.backends as fb

    for registry in [*fb._operation_registries.values(), *fb._function_registries.values()]:
        registry._logged.clear()
    log = RouteLog()
    logger = logging.getLogger("fla.backends")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        yield log
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)


def route_of(lines: list[str], op: str) -> str:
    """Which implementation ran ``op`` per fla's log: a backend's name, or ``"fla"`` (its own function)."""
    fn = {"fused_recurrent_kda": "fused_recurrent_kda_fwd"}.get(op, op)
    ran = [ln.rsplit("-> ", 1)[1] for ln in lines if f"{fn} -> " in ln and "rejected" not in ln]
    return ran[0] if ran else "fla"


@dataclass
class Outcome:
    """One implementation's results on a case: output, final state, gradients by name, route, or why it failed."""

    o: Tensor | None = None
    ht: Tensor | None = None
    grads: dict[str, Tensor] = field(default_factory=dict)
    route: str = ""
    error: str | None = None


def run(case: Case, x: dict[str, Any], call: Callable[[Case, dict[str, Any]], tuple[Tensor, Tensor | None]]) -> Outcome:
    """``call`` on fresh leaves of ``x`` (requiring grad where the case takes gradients), fixed output gradients."""
    names = leaves(case, x) if case.grad else []
    f64 = call is call_reference
    xs = {n: (v.detach().to(torch.float64) if f64 and isinstance(v, Tensor) and v.is_floating_point() else v)
          for n, v in x.items()}  # fmt: skip
    for n in names:
        xs[n] = xs[n].detach().clone().requires_grad_()
    out = Outcome()
    try:
        with routes() as log:
            o, ht = call(case, xs)
        out.route = route_of(log.lines, case.op)
        out.o, out.ht = o.detach(), None if ht is None else ht.detach()
        if names:
            gen = torch.Generator(device="cpu").manual_seed(7)
            do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
            loss = (o * do).sum()
            if ht is not None:
                loss = loss + (ht * torch.randn(ht.shape, generator=gen).to(ht.device, ht.dtype)).sum()
            grads = torch.autograd.grad(loss, [xs[n] for n in names])
            out.grads = {n: gr.detach() for n, gr in zip(names, grads)}
    except Exception as exc:  # fla refusing a call (e.g. its Hopper backward check) is a result, not a crash
        out.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return out


def compare(
    case: Case, dims: Dims, dtype: torch.dtype, device: torch.device, seed: int = 0, policy: str = "always"
) -> dict[str, Any]:
    """One row: the errors of dtune and of fla against the float64 reference and of dtune against fla (the worst over
    the output, the final state and every gradient), the routes, and whether dtune agrees within bf16 error: its error
    at most twice fla's or the dtype's gate tolerance, whichever is larger, on every tensor. ``policy``: the
    backend's (:func:`dtune.integrations.fla.enable`) for the call with dtune."""
    x = make_inputs(case, dims, dtype, device, seed)
    dtune_fla.disable()
    theirs = run(case, x, call_fla) if device.type == "cuda" else Outcome(error="fla's kernels need a GPU")
    dtune_fla.enable(policy)
    try:
        ours = run(case, x, call_fla)
    finally:
        dtune_fla.disable()
    ref = run(case, x, call_reference)
    row: dict[str, Any] = {"case": case.name, "route_with": ours.route, "route_without": theirs.route or "-"}
    if ours.error or ref.error:
        return {**row, "agree": False, "note": ours.error or ref.error}
    tensors = ["o", "ht", *ours.grads]

    def get(out: Outcome, name: str) -> Tensor | None:
        return getattr(out, name) if name in ("o", "ht") else out.grads.get(name)

    worst: dict[str, tuple[float, str]] = {}
    agree = ours.route == "dtune"
    floor = FLOOR.get(dtype, 2e-2)
    for name in tensors:
        a, r, f = get(ours, name), get(ref, name), get(theirs, name)  # what fla computed before any refusal
        assert a is not None and r is not None
        e_ours = rel_rms_error(a, r)
        e_fla = rel_rms_error(f, r) if f is not None else math.nan
        e_vs = rel_rms_error(a, f) if f is not None else math.nan
        agree = agree and e_ours <= max(2 * e_fla if f is not None else 0.0, floor)
        for key, e in (("dtune_vs_ref", e_ours), ("fla_vs_ref", e_fla), ("dtune_vs_fla", e_vs)):
            if not math.isnan(e) and (key not in worst or e > worst[key][0]):
                worst[key] = (e, name)
    row.update({k: f"{e:.2e} ({n})" for k, (e, n) in worst.items()})
    note = theirs.error or ("" if ours.route == "dtune" else "not routed to dtune")
    if theirs.error and theirs.o is not None:  # e.g. fla's Hopper check of its gated backward: its forward still counts
        note = f"fla's forward compared, its gradients not ({theirs.error})"
    return {**row, "agree": agree, "note": note}
