"""Triton kernels of flash-linear-attention's in-kernel options as separate passes: one read and one write per element.

* :func:`l2norm_fwd` / :func:`l2norm_bwd` — ``y = x / sqrt(Σ x² + eps)`` over the last dim (use_qk_l2norm_in_kernel),
  computed in float32, ``y`` stored in x's dtype; the backward ``dx = r·dy − r³ (x·dy) x`` from x and the saved
  ``r = 1 / sqrt(Σ x² + eps)``. Bytes per element (16-bit x): forward 2 + 2, backward 2 + 2 + 2.
* :func:`gate_fwd` / :func:`gate_bwd` — the log-space gate of use_gate_in_kernel from the raw ``g``:
  ``-exp(A_log) · softplus(g + dt_bias)`` (softplus linear above 20, as fla's), or with ``lower_bound``
  ``lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (``A_log`` None: ``lower_bound · sigmoid(g + dt_bias)``), in
  float32. KDA's gate is ``[rows, HV, K]`` with ``A_log [HV]`` and ``dt_bias [HV, K]``; Gated DeltaNet's ``[rows, HV]``
  with both ``[HV]``. The backward returns dg in g's dtype and dA_log, ddt_bias from per-block partial sums.
  Bytes per element: forward 2 + 4, backward 4 + 2 + 2 (the gate's gradient, g, dg).

No dtune imports: the wrappers with autograd are ``dtune.options``; the formulas in float64 are ``reference``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .config import next_power_of_2

Tensor = torch.Tensor
ROWS = 64  # rows per program of the gate kernels (a token block)
TILE = 4096  # elements per program of the l2norm kernels
L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)  # fla's l2norm_fwd default


@dataclass(frozen=True)
class InKernel:
    """fla's in-kernel options as the kernel applies them (the defaults: none). ``A_log`` ``[HV]``, ``dt_bias``
    ``[HV]`` (scalar gate) or ``[HV * K]`` (per key channel), ``lower_bound`` are used with ``gate_activation``;
    ``beta_sigmoid``: 0 (beta as given), 1 (``sigmoid(beta)``), 2 (``2 · sigmoid(beta)``, fla's allow_neg_eigval);
    ``state_vk``: initial and final states ``[N, HV, V, K]``."""

    l2norm: bool = False
    gate_activation: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None
    beta_sigmoid: int = 0
    state_vk: bool = False

    def flags(self) -> tuple[Any, ...]:
        """The options' values other than tensors (a launch cache key's part: the tensors are the call's)."""
        return (self.l2norm, self.gate_activation, self.lower_bound, self.beta_sigmoid, self.state_vk)

    def gate_code(self) -> int:
        """The gate activation as the chunk kernels' ``GACT`` constexpr: its form (0 none, 1 softplus, 2 bounded)
        + 4 with ``dt_bias`` + 8 with ``A_log``."""
        if not self.gate_activation:
            return 0
        form = 2 if self.lower_bound is not None else 1
        return form + 4 * (self.dt_bias is not None) + 8 * (self.A_log is not None)

    def chunk_args(self) -> dict[str, object]:
        """The chunk forward's keyword arguments of the l2norm and beta's activation (none without them): every stage
        that loads q, k or beta applies them (``L2NORM``, ``BETA_ACT``)."""
        args: dict[str, object] = {}
        if self.l2norm:
            args["L2NORM"] = True
        if self.beta_sigmoid:
            args["BETA_ACT"] = self.beta_sigmoid
        return args

    def gate_args(self) -> dict[str, object]:
        """The chunk kernels' keyword arguments of the gate activation (none without it)."""
        if not self.gate_activation:
            return {}
        A = None if self.A_log is None else self.A_log.reshape(-1).contiguous()
        bias = None if self.dt_bias is None else self.dt_bias.reshape(-1).contiguous()
        lb = 0.0 if self.lower_bound is None else float(self.lower_bound)
        return {"A_log": A, "dt_bias": bias, "lower_bound": lb, "GACT": self.gate_code()}


NO_IN_KERNEL = InKernel()


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def activated_gate(b_x, b_a, b_bias, lower_bound, ACT: tl.constexpr):
    """The log-space gate from the raw ``b_x`` (float32): ``ACT`` 0 as given, 1 ``−a · softplus(x + bias)``, 2
    ``lower_bound · sigmoid(a · (x + bias))``, with ``a = exp(A_log)`` (1 without ``A_log``)."""
    if ACT == 1:
        return -b_a * _softplus(b_x + b_bias)
    elif ACT == 2:
        return lower_bound * tl.sigmoid(b_a * (b_x + b_bias))
    else:
        return b_x


@triton.jit
def activated_beta(b_beta, BETA_ACT: tl.constexpr):
    """beta (float32) as given (``BETA_ACT`` 0), ``sigmoid(beta)`` (1) or ``2 · sigmoid(beta)`` (2, allow_neg_eigval)."""
    if BETA_ACT > 0:
        return tl.sigmoid(b_beta) * BETA_ACT
    return b_beta


@triton.jit
def rnorm(b_x, AXIS: tl.constexpr):
    """The l2norm's factor ``1 / sqrt(Σ x² + eps)`` of a float32 tile along ``AXIS`` (the whole key dimension)."""
    return 1.0 / tl.sqrt(tl.sum(b_x * b_x, AXIS) + L2NORM_EPS)


@triton.jit
def gate_act(A_log, dt_bias, lower_bound, i_hv, K: tl.constexpr, GATE: tl.constexpr, GACT: tl.constexpr):
    """The program's gate activation (fla's ``use_gate_in_kernel``; ``GACT``: ``InKernel.gate_code``) as the tuple the
    gate loads take: ``exp(A_log)`` of value head ``i_hv`` (1 without), its ``dt_bias`` (Gated DeltaNet: the value;
    KDA: a pointer to its ``K`` channels) and ``lower_bound``. Unused (and never loaded) when ``GACT`` is 0."""
    b_a = 1.0
    if (GACT // 8) % 2 == 1:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = 0.0
    if (GACT // 4) % 2 == 1:
        if GATE == 2:
            bias = dt_bias + i_hv * K
        else:
            bias = tl.load(dt_bias + i_hv).to(tl.float32)
    return (b_a, bias, lower_bound)


@triton.jit
def qk_l2norm_fwd_kernel(x, y, rstd, rows, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r[:, None] < rows) & (o_d[None, :] < D)
    offs = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    b_r = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + offs, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=o_r < rows)


@triton.jit
def qk_l2norm_bwd_kernel(x, rstd, dy, dx, rows, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (o_r[:, None] < rows) & (o_d[None, :] < D)
    offs = o_r[:, None] * D + o_d[None, :]
    b_x = tl.load(x + offs, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + offs, mask=m, other=0.0).to(tl.float32)
    b_r = tl.load(rstd + o_r, mask=o_r < rows, other=0.0)
    b_s = tl.sum(b_x * b_dy, 1) * b_r * b_r * b_r
    b_dx = b_dy * b_r[:, None] - b_x * b_s[:, None]
    tl.store(dx + offs, b_dx.to(dx.dtype.element_ty), mask=m)


def _row_tile(D: int) -> tuple[int, int]:
    BD = next_power_of_2(D)
    return BD, max(1, TILE // BD)


def l2norm_fwd(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: y in x's dtype and shape, rstd float32 of x's shape without the last dim."""
    x = x.contiguous()
    D = x.shape[-1]
    rows = x.numel() // D
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    BD, BR = _row_tile(D)
    if rows:
        qk_l2norm_fwd_kernel[(triton.cdiv(rows, BR),)](x, y, rstd, rows, eps, D=D, BD=BD, BR=BR)
    return y, rstd


def l2norm_bwd(x: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    """dx in x's dtype."""
    x, dy = x.contiguous(), dy.contiguous()
    D = x.shape[-1]
    rows = x.numel() // D
    dx = torch.empty_like(x)
    BD, BR = _row_tile(D)
    if rows:
        qk_l2norm_bwd_kernel[(triton.cdiv(rows, BR),)](x, rstd, dy, dx, rows, D=D, BD=BD, BR=BR)
    return dx


@triton.jit
def _gate_rows(
    g,
    A_log,
    dt_bias,
    rows,
    NH: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    SCALAR: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The program's rows of g as [rows, NH, D]: their offsets and mask, the biased input x and the factor a = exp(A_log)
    (KDA NH = HV heads of D = K channels; Gated DeltaNet NH = 1, D = HV: the heads are columns)."""
    i_r, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_r = i_r * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = (o_r[:, None] < rows) & m_d[None, :]
    offs = (o_r[:, None] * NH + i_h) * D + o_d[None, :]
    b_x = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(dt_bias + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if HAS_A:
        if SCALAR:
            b_a = tl.exp(tl.load(A_log + o_d, mask=m_d, other=0.0).to(tl.float32))[None, :]
        else:
            b_a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    else:
        b_a = 1.0
    return offs, m, b_x, b_a


@triton.jit
def raw_gate_fwd_kernel(
    g,
    A_log,
    dt_bias,
    out,
    rows,
    lower_bound,
    NH: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    SCALAR: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    offs, m, b_x, b_a = _gate_rows(g, A_log, dt_bias, rows, NH, D, BD, BR, SCALAR, HAS_A, HAS_BIAS)
    tl.store(out + offs, activated_gate(b_x, b_a, 0.0, lower_bound, 2 if BOUNDED else 1), mask=m)


@triton.jit
def raw_gate_bwd_kernel(
    g,
    A_log,
    dt_bias,
    dout,
    dg,
    dA_part,
    dbias_part,
    rows,
    lower_bound,
    NH: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    SCALAR: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    offs, m, b_x, b_a = _gate_rows(g, A_log, dt_bias, rows, NH, D, BD, BR, SCALAR, HAS_A, HAS_BIAS)
    b_do = tl.load(dout + offs, mask=m, other=0.0).to(tl.float32)
    if BOUNDED:  # o = lb·σ(z), z = a·x: do/dx = lb·σ(1 − σ)·a, do/dA_log = lb·σ(1 − σ)·z
        b_z = b_a * b_x
        b_s = tl.sigmoid(b_z)
        b_ds = b_do * lower_bound * b_s * (1.0 - b_s)
        b_dx = b_ds * b_a
        b_da = b_ds * b_z
    else:  # o = −a·softplus(x): do/dx = −a·σ(x), do/dA_log = o
        b_dx = -b_do * b_a * tl.sigmoid(b_x)
        b_da = -b_do * b_a * _softplus(b_x)
    tl.store(dg + offs, b_dx.to(dg.dtype.element_ty), mask=m)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    part = (tl.program_id(0).to(tl.int64) * NH + tl.program_id(1)) * D + o_d
    if HAS_A:
        tl.store(dA_part + part, tl.sum(b_da, 0), mask=m_d)  # masked rows: dout = 0, so their terms are 0
    if HAS_BIAS:
        tl.store(dbias_part + part, tl.sum(b_dx, 0), mask=m_d)


def _gate_layout(g: Tensor) -> tuple[int, int, int, bool]:
    """``(rows, NH, D, scalar)`` of a gate ``[B, T, HV]`` (scalar) or ``[B, T, HV, K]``."""
    if g.dim() == 4:
        return g.shape[0] * g.shape[1], g.shape[2], g.shape[3], False
    return g.shape[0] * g.shape[1], 1, g.shape[2], True


def gate_fwd(g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None) -> Tensor:
    """The float32 log-space gate of ``g`` (see the module docstring)."""
    g = g.contiguous()
    rows, NH, D, scalar = _gate_layout(g)
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    BD = next_power_of_2(D)
    if rows:
        raw_gate_fwd_kernel[(triton.cdiv(rows, ROWS), NH)](
            g, A_log, dt_bias, out, rows, 0.0 if lower_bound is None else float(lower_bound),
            NH=NH, D=D, BD=BD, BR=ROWS, SCALAR=scalar, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None,
            BOUNDED=lower_bound is not None,
        )  # fmt: skip
    return out


def gate_bwd(
    g: Tensor, A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None, dout: Tensor
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(dg, dA_log, ddt_bias)``: dg in g's dtype, the others float32 in their parameters' shapes (None without)."""
    g, dout = g.contiguous(), dout.contiguous()
    rows, NH, D, scalar = _gate_layout(g)
    nblocks = triton.cdiv(rows, ROWS)
    dg = torch.empty_like(g)
    dA_part = torch.empty(nblocks, NH, D, dtype=torch.float32, device=g.device) if A_log is not None else None
    dbias_part = torch.empty(nblocks, NH, D, dtype=torch.float32, device=g.device) if dt_bias is not None else None
    if rows:
        raw_gate_bwd_kernel[(nblocks, NH)](
            g, A_log, dt_bias, dout, dg, dA_part, dbias_part, rows, 0.0 if lower_bound is None else float(lower_bound),
            NH=NH, D=D, BD=next_power_of_2(D), BR=ROWS, SCALAR=scalar, HAS_A=A_log is not None,
            HAS_BIAS=dt_bias is not None, BOUNDED=lower_bound is not None,
        )  # fmt: skip
    dA = None
    if A_log is not None:
        assert dA_part is not None
        per = dA_part.sum(0)  # [NH, D]
        dA = (per.reshape(-1) if scalar else per.sum(1)).reshape(A_log.shape) if rows else torch.zeros_like(A_log)
    dbias = None
    if dt_bias is not None:
        assert dbias_part is not None
        dbias = dbias_part.sum(0).reshape(dt_bias.shape) if rows else torch.zeros_like(dt_bias, dtype=torch.float32)
    return dg, dA, dbias
