"""Models (``dtune/models.toml``): the shapes real models call the kernels with, per tensor-parallel degree, as the
buckets that ``dtune tune-gpu --models`` tunes.

A model names its family (the kernels it calls: ``chunk_<family>`` for prefill and the training step's forward,
``chunk_<family>_bwd`` for its backward, ``fused_recurrent_<family>`` for decode), its heads and head dim; the file's
``[buckets]`` says which calls every model is tuned for. At degree ``tp`` a GPU holds ``heads / tp`` query/key heads
and ``v_heads / tp`` value heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from dtune._toml import TOMLDecodeError, loads
from dtune.shape import Gate, Shape, packed_and_grouped

SOURCE = "dtune/models.toml"
FAMILIES = ("delta_rule", "gated_delta_rule", "kda")
MODEL_KEYS = ("family", "layer", "hidden_size", "heads", "v_heads", "head_dim")
CALL_KEYS = ("tensor_parallel", "prefill_seq_lens", "packed_prefill", "train_tokens", "train_seq_len", "decode_batch")


@dataclass(frozen=True)
class Model:
    """One model's attention layer: ``heads`` query/key heads and ``v_heads`` value heads of ``head_dim``."""

    name: str
    family: str
    layer: str  # its fla.layers class
    hidden_size: int
    heads: int
    v_heads: int
    head_dim: int

    @property
    def kernels(self) -> tuple[str, str, str]:
        """The chunk forward, its backward and the fused-recurrent kernel of the model's family."""
        f = self.family
        return (f"chunk_{f}", f"chunk_{f}_bwd", f"fused_recurrent_{f}")

    def heads_at(self, tp: int) -> tuple[int, int]:
        """``(H, HV)`` on one GPU at tensor-parallel degree ``tp``; ValueError where the degree does not divide them."""
        if tp < 1 or self.heads % tp:
            raise ValueError(f"{self.name}: its {self.heads} heads do not divide by the tensor-parallel degree {tp}")
        return self.heads // tp, self.v_heads // tp


@dataclass(frozen=True)
class Calls:
    """``[buckets]``: the calls every model is tuned for."""

    tensor_parallel: tuple[int, ...]
    prefill_seq_lens: tuple[int, ...]  # one prompt, B = 1
    packed_prefill: tuple[int, ...]  # one packed batch's sequence lengths (empty: none)
    train_tokens: int  # B * T of a training step
    train_seq_len: int
    decode_batch: tuple[int, ...]  # T = 1

    @property
    def train_batch(self) -> int:
        return max(1, self.train_tokens // self.train_seq_len)


@dataclass(frozen=True)
class Models:
    models: dict[str, Model]
    calls: Calls

    def get(self, names: Sequence[str]) -> list[Model]:
        """The models called ``names`` (``all``: every one), in the file's order; ValueError naming an unknown one."""
        if list(names) == ["all"]:
            return list(self.models.values())
        unknown = [n for n in names if n not in self.models]
        if unknown or not names:
            known = ", ".join(self.models)
            raise ValueError(f"unknown model {', '.join(unknown) or '(none given)'}: {SOURCE} has {known} (or all)")
        return [self.models[n] for n in dict.fromkeys(names)]

    def shapes(self, model: Model, kernel: str, degrees: Sequence[int], gate: Gate) -> tuple[list[Shape], list[Shape]]:
        """The buckets ``model`` calls ``kernel`` with at each tensor-parallel degree: ``(shapes, packed)``, the
        packed batch's shapes as calls with ``cu_seqlens`` look them up (none for a kernel not of the model)."""
        c, D = self.calls, model.head_dim
        plain: list[Shape] = []
        packed: list[Shape] = []
        for tp in degrees:
            H, HV = model.heads_at(tp)
            if kernel == f"chunk_{model.family}":
                plain += [Shape(1, T, H, HV, D, D, gate=gate) for T in c.prefill_seq_lens]
                plain.append(Shape(c.train_batch, c.train_seq_len, H, HV, D, D, gate=gate))
                if c.packed_prefill:
                    (one,) = packed_and_grouped([Shape(1, 1, H, H, D, D, gate=gate)], c.packed_prefill, HV // H)
                    packed.append(one)
            elif kernel == f"chunk_{model.family}_bwd":
                plain.append(Shape(c.train_batch, c.train_seq_len, H, HV, D, D, gate=gate))
            elif kernel == f"fused_recurrent_{model.family}":
                plain += [Shape(B, 1, H, HV, D, D, gate=gate) for B in c.decode_batch]
        return list(dict.fromkeys(plain)), list(dict.fromkeys(packed))


def _positive(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _ints(value: Any, where: str, allow_empty: bool = False) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_positive(x) for x in value) or not (value or allow_empty):
        raise ValueError(f"{SOURCE}: {where} must be a list of positive integers, got {value!r}")
    return tuple(value)


def parse(doc: Mapping[str, Any]) -> Models:
    """The models and calls of a parsed ``models.toml``; ValueError naming the first problem."""
    extra = set(doc) - {"models", "buckets"}
    if extra or not isinstance(doc.get("models"), dict) or not isinstance(doc.get("buckets"), dict):
        raise ValueError(f"{SOURCE}: expected the tables [models.<name>] and [buckets] only (got {sorted(doc)})")
    models: dict[str, Model] = {}
    for name, m in doc["models"].items():
        if not isinstance(m, dict) or set(m) != set(MODEL_KEYS):
            got = sorted(m) if isinstance(m, dict) else m
            raise ValueError(f"{SOURCE}: [models.{name}] must have exactly {', '.join(MODEL_KEYS)} (got {got})")
        if m["family"] not in FAMILIES:
            raise ValueError(f"{SOURCE}: [models.{name}] family {m['family']!r} is not one of {', '.join(FAMILIES)}")
        for key in ("hidden_size", "heads", "v_heads", "head_dim"):
            if not _positive(m[key]):
                raise ValueError(f"{SOURCE}: [models.{name}] {key} must be a positive integer, got {m[key]!r}")
        if m["v_heads"] % m["heads"]:
            raise ValueError(
                f"{SOURCE}: [models.{name}] v_heads {m['v_heads']} is not a multiple of heads {m['heads']}"
            )
        models[name] = Model(name, m["family"], str(m["layer"]), m["hidden_size"], m["heads"], m["v_heads"],
                             m["head_dim"])  # fmt: skip
    b = doc["buckets"]
    if set(b) != set(CALL_KEYS):
        raise ValueError(f"{SOURCE}: [buckets] must have exactly {', '.join(CALL_KEYS)} (got {sorted(b)})")
    for key in ("train_tokens", "train_seq_len"):
        if not _positive(b[key]):
            raise ValueError(f"{SOURCE}: [buckets] {key} must be a positive integer, got {b[key]!r}")
    calls = Calls(
        _ints(b["tensor_parallel"], "[buckets] tensor_parallel"),
        _ints(b["prefill_seq_lens"], "[buckets] prefill_seq_lens", allow_empty=True),
        _ints(b["packed_prefill"], "[buckets] packed_prefill", allow_empty=True),
        b["train_tokens"],
        b["train_seq_len"],
        _ints(b["decode_batch"], "[buckets] decode_batch", allow_empty=True),
    )
    for model in models.values():
        for tp in calls.tensor_parallel:
            model.heads_at(tp)
    return Models(models, calls)


def load(text: str | None = None) -> Models:
    """The shipped models (read once per process), or those of ``text``, a models.toml's content."""
    return _shipped() if text is None else _parse_text(text)


@lru_cache(maxsize=1)
def _shipped() -> Models:
    return _parse_text(resources.files("dtune").joinpath("models.toml").read_text(encoding="utf-8"))


def _parse_text(text: str) -> Models:
    try:
        doc = loads(text)
    except TOMLDecodeError as e:
        raise ValueError(f"{SOURCE}: not valid TOML ({e})") from None
    return parse(doc)


__all__ = ["Calls", "Model", "Models", "load", "parse"]
