"""The fla backend's speed rule on a shape, without fla: does a tuned-config file record dtune at least as fast as the
implementation that would run instead, at a bucket near enough to speak for the shape?

The measurement that decides is the nearest entry (:meth:`dtune.store.TunedConfigs.nearest`) of the kernel (its
``*_bwd`` entry for a training step) at the shape's head dims and value-head ratio whose ``side_by_side_ms`` records
dtune and the peer (any other implementation when the peer is unknown) and whose bucket lies within a factor of
:data:`NEAR` of the shape in tokens per sequence, sequences and heads (a measurement speaks for no shape farther).
:mod:`dtune.integrations.fla` asks it on every new call shape; ``dtune list --shape`` prints it for a shape and GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dtune.kernels import get_kernel
from dtune.shape import Shape
from dtune.store import Entry, TunedConfigs

NEAR = 2.0  # a measured bucket speaks for shapes within this factor of its tokens per sequence, sequences and heads


def near(shape: Shape, bucket: Mapping[str, int]) -> bool:
    """Whether ``bucket`` lies within :data:`NEAR` of ``shape`` in tokens per sequence, sequences and heads."""
    tokens = shape.T // max(shape.N, 1) if shape.varlen else shape.T
    pairs = ((tokens, bucket["T"]), (shape.N, bucket["B"]), (shape.H, bucket["H"]))
    return all(abs(math.log(max(a, 1) / b)) <= math.log(NEAR) + 1e-9 for a, b in pairs)


def bucket_text(b: Mapping[str, int]) -> str:
    return f"B{b['B']} T{b['T']} H{b['H']} HV{b['HV']} K{b['K']} V{b['V']}"


def speed_verdict(
    configs: TunedConfigs | None, kernel: str, shape: Shape, dtype: str, peer: str | None, grad: bool
) -> tuple[bool, str | None]:
    """``(True, None)`` when ``configs`` (the tuned configs in force on the GPU; None: none) record dtune at least as
    fast as ``peer`` (None: as every other implementation recorded) at the nearest measured bucket of ``kernel`` (a
    forward op's name; its backward's entries for a training step, ``grad``), near enough to ``shape``; else
    ``(False, why)``."""
    spec = get_kernel(kernel)
    name = spec.backward_kernel if grad and spec.backward_kernel else spec.name
    what = "training step" if grad else "forward"
    against = peer or "the other implementations"
    dims = (shape.K, shape.V, shape.HV // shape.H)

    def same_dims(e: Entry) -> bool:  # a measurement at other head dims or head ratio says nothing of this call
        return (e.bucket["K"], e.bucket["V"], e.bucket["HV"] // e.bucket["H"]) == dims

    def measured(e: Entry) -> bool:
        times = e.side_by_side_ms
        return same_dims(e) and "dtune" in times and (peer in times if peer is not None else len(times) > 1)

    if configs is None or configs.nearest(name, dtype, shape, same_dims) is None:
        return False, f"no tuned {name} entry for this GPU, dtype and head dims: no measurement against {against}"
    entry = configs.nearest(name, dtype, shape, lambda e: measured(e) and near(shape, e.bucket))
    if entry is None:  # (the bucket order puts the sequence length first: a near one may rank after a far one)
        far = configs.nearest(name, dtype, shape, measured)
        if far is None:
            return False, f"no {name} bucket records a side-by-side {what} time of dtune and {against}"
        where = bucket_text(far.bucket)
        return False, f"the nearest measured bucket ({name} {where}) is not within {NEAR:g}x of this shape"
    where = bucket_text(entry.bucket)
    times = entry.side_by_side_ms
    others = {n: t for n, t in times.items() if n != "dtune"} if peer is None else {peer: times[peer]}
    best_name, best = min(others.items(), key=lambda nt: nt[1])
    if times["dtune"] > best:
        return False, (
            f"{best_name} is faster at {name} {where}: {best:.4g} ms against dtune's {times['dtune']:.4g} ms"
        )
    return True, None
