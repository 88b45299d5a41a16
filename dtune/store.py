"""Tuned-config store and run-time dispatch: which config an op launches when the caller passes none.

:func:`tuned_config` runs on every op call (decode steps included), so after the first call for a given (kernel,
shape, dtype, device) it is one dict lookup; the only device query is the GPU's name, cached. Sources, first match
wins: a file loaded with :func:`load_configs`; the file named by ``DTUNE_CONFIG``; the configs shipped for this GPU in
``dtune/configs/<gpu>.json`` over those of a GPU of its kind (:func:`kin_gpu`: same architecture, shared memory and
registers; an H100 reads the H200's): its own entry of a bucket wins, the kin's fill the buckets its file lacks
(:func:`overlay`; so a GPU tuned in part runs its own configs where it has them). Within a file the entries of the
call's kernel and dtype are candidates: the call's own bucket (:meth:`dtune.shape.Shape.lookup_bucket`) is used verbatim
(``exact``); else the config is built from the nearest tuned buckets and adjusted to the shape (``borrowed``:
:mod:`dtune.borrow` — the same head dims first, then the nearest sequence length, with the sequence-parallel segment
length for the call's sequences and tiles fitted to its head dims); with no entry for the kernel and dtype, None (the
template's default). :func:`tuned_choice` says which it was and what was changed. Every config is re-checked against
the template's legal values when the file is read. A corrupt or mismatched file is an error when loaded explicitly and
a warning (the defaults are used) from ``DTUNE_CONFIG`` or the shipped folder: never a wrong kernel. On the CPU
(Triton's interpreter) there is no tuned config: None.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from dtune.borrow import Choice, borrow, distance
from dtune.errors import FileProblem
from dtune.inputs import DTYPE_NAMES, dtype_name
from dtune.kernels import get_kernel
from dtune.shape import BUCKET_KEYS, Gate, Shape

SCHEMA = 1
ENV = "DTUNE_CONFIG"


class ConfigFileError(FileProblem):
    """A tuned-config file that cannot be used (the message names the file and the problem)."""


@dataclass(frozen=True)
class Entry:
    kernel: str
    dtype: str
    bucket: dict[str, int]
    config: dict[str, Any]
    # The call's median time by implementation ("dtune" with this config, "fla", an fla backend such as
    # "flash_qla"), measured side by side in one run; optional, {} when the file records none.
    side_by_side_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class TunedConfigs:
    """One parsed tuned-config file, indexed for lookup."""

    gpu: str
    gpu_name: str
    source: str
    entries: list[Entry]
    # the file of each entry that came from another (:func:`overlay`), by (kernel, dtype, bucket); the rest: source's
    origins: dict[tuple[str, str, tuple[tuple[str, int], ...]], str] = field(default_factory=dict)
    _index: dict[tuple[str, str], list[Entry]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for e in self.entries:
            self._index.setdefault((e.kernel, e.dtype), []).append(e)
        self._name = Path(self.source).name

    @property
    def sm_count(self) -> int | None:
        """The SMs of the file's GPU (its profile in dtune/gpus.toml), None for a GPU dtune has no profile of."""
        from dtune.gpu import GpuError, get_profile

        try:
            return get_profile(self.gpu).sm_count
        except GpuError:
            return None

    def nearest(
        self, kernel: str, dtype: str, shape: Shape, keep: Callable[[Entry], bool] | None = None
    ) -> Entry | None:
        """The entry of ``kernel`` and ``dtype`` nearest to ``shape`` (:func:`dtune.borrow.distance`: head dims, the
        value-head ratio, then the bucket), verbatim, among those ``keep`` accepts (all by default); None when there
        is none."""
        candidates = [e for e in self._index.get((kernel, dtype), []) if keep is None or keep(e)]
        return min(candidates, key=lambda e: distance(shape, e.bucket)) if candidates else None

    def choose(self, kernel: str, dtype: str, shape: Shape) -> Choice | None:
        """The config for ``shape`` and where it came from (see the module's docstring), or None (the default)."""
        candidates = self._index.get((kernel, dtype))
        choice = borrow(candidates, kernel, dtype, shape, self.sm_count) if candidates else None
        if choice is None:
            return None
        return replace(choice, source=self.origins.get((kernel, dtype, _bucket_key(choice.bucket)), self._name))

    def lookup(self, kernel: str, dtype: str, shape: Shape) -> dict[str, Any] | None:
        """The config of :meth:`choose`, or None."""
        choice = self.choose(kernel, dtype, shape)
        return dict(choice.config) if choice is not None else None

    def without(self, kernel: str, dtype: str, bucket: dict[str, int]) -> TunedConfigs:
        """This file with one bucket's entry hidden (the leave-one-out check)."""
        kept = [e for e in self.entries if (e.kernel, e.dtype, e.bucket) != (kernel, dtype, bucket)]
        return TunedConfigs(self.gpu, self.gpu_name, self.source, kept, dict(self.origins))

    def shapes(self, kernel: str, dtype: str, gate: Gate = Gate.NONE) -> list[Shape]:
        """The buckets tuned for ``kernel`` and ``dtype``, as shapes (each once), by head dim, T, B, H."""
        buckets = {
            tuple(e.bucket[k] for k in BUCKET_KEYS) for e in self.entries if (e.kernel, e.dtype) == (kernel, dtype)
        }
        shapes = [Shape.from_dict(dict(zip(BUCKET_KEYS, b)), gate) for b in buckets]
        return sorted(shapes, key=lambda s: (s.K, s.T, s.B, s.H))


def _bucket_key(bucket: dict[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(bucket.items()))


def overlay(own: TunedConfigs, kin: TunedConfigs) -> TunedConfigs:
    """``own``'s entries, and ``kin``'s (a GPU of its kind: its configs are legal here) for every (kernel, dtype,
    bucket) that ``own`` lacks: one set for the lookup, exact and borrowed alike; each entry keeps its file's name
    (:attr:`TunedConfigs.origins`, what :meth:`TunedConfigs.choose` reports)."""
    have = {(e.kernel, e.dtype, _bucket_key(e.bucket)) for e in own.entries}
    extra = [e for e in kin.entries if (e.kernel, e.dtype, _bucket_key(e.bucket)) not in have]
    origins = dict(own.origins)
    origins.update({(e.kernel, e.dtype, _bucket_key(e.bucket)): Path(kin.source).name for e in extra})
    return TunedConfigs(own.gpu, own.gpu_name, own.source, own.entries + extra, origins)


def _fail(source: str, message: str) -> ConfigFileError:
    return ConfigFileError(f"tuned-config file {source}: {message}")


def parse_configs(doc: Any, source: str, gpu: str | None = None) -> TunedConfigs:
    """Validate a tuned-config document; ``gpu``: the key it must be for (None: not checked)."""
    if not isinstance(doc, dict):
        raise _fail(source, "not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise _fail(source, f"schema {doc.get('schema')!r} is not supported (this dtune reads schema {SCHEMA})")
    file_gpu = doc.get("gpu")
    if not isinstance(file_gpu, str):
        raise _fail(source, "lacks the GPU key (`gpu`)")
    if gpu is not None and file_gpu != gpu:
        raise _fail(source, f"is for GPU {file_gpu!r}, but this is {gpu!r}")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise _fail(source, "lacks the `entries` list")
    entries = []
    for i, e in enumerate(raw):
        if not isinstance(e, dict):
            raise _fail(source, f"entry {i} is not an object")
        try:
            spec = get_kernel(str(e.get("kernel")))
        except ValueError as err:
            raise _fail(source, f"entry {i}: {err}") from None
        if e.get("dtype") not in DTYPE_NAMES:
            raise _fail(source, f"entry {i}: unknown dtype {e.get('dtype')!r}")
        bucket = e.get("bucket")
        if not isinstance(bucket, dict) or not all(
            isinstance(bucket.get(k), int) and bucket[k] > 0 for k in BUCKET_KEYS
        ):
            raise _fail(source, f"entry {i}: bucket must give positive integers {list(BUCKET_KEYS)}")
        if bucket["HV"] % bucket["H"]:
            raise _fail(source, f"entry {i}: bucket HV={bucket['HV']} is not a multiple of H={bucket['H']}")
        config = e.get("config")
        if not isinstance(config, dict):
            raise _fail(source, f"entry {i}: config must be an object")
        try:
            spec.check_config(bucket["K"], bucket["V"], config)
        except (ValueError, TypeError) as err:
            raise _fail(source, f"entry {i}: illegal config: {err}") from None
        times = _side_by_side(source, i, e.get("side_by_side_ms", {}))
        entries.append(Entry(spec.name, e["dtype"], {k: bucket[k] for k in BUCKET_KEYS}, dict(config), times))
    return TunedConfigs(file_gpu, str(doc.get("gpu_name", file_gpu)), source, entries)


def _side_by_side(source: str, i: int, times: Any) -> dict[str, float]:
    """An entry's optional ``side_by_side_ms``: implementation name -> positive finite median time."""
    ok = isinstance(times, dict) and all(
        isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf
        for k, t in times.items()
    )
    if not ok:
        raise _fail(source, f"entry {i}: side_by_side_ms must map implementation names to positive times in ms")
    return {k: float(t) for k, t in times.items()}


def read_configs(path: str | Path, gpu: str | None = None) -> TunedConfigs:
    """Read and validate a tuned-config file; ConfigFileError naming the problem."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise _fail(str(path), f"cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(str(path), f"is not valid JSON ({e})") from None
    return parse_configs(doc, str(path), gpu)


# ---- run-time state -------------------------------------------------------------------------------------

_explicit: TunedConfigs | None = None
_loaded: dict[str, TunedConfigs | None] = {}  # by GPU key: the file in force for that GPU (None: defaults)
_cache: dict[tuple[Any, ...], Choice | None] = {}
# Lookups kept (the oldest forgotten first): packed batches make a new shape of every total length they have.
CACHE_SIZE = 4096


def load_configs(path: str | Path, gpu: str | None = None) -> TunedConfigs:
    """Use the tuned configs in ``path`` from now on (over ``DTUNE_CONFIG`` and the shipped ones).

    Errors (ConfigFileError) for a corrupt file, or one for another GPU than ``gpu`` (default: the CUDA GPU
    present, when there is one).
    """
    global _explicit
    from dtune.gpu import detect

    configs = read_configs(path, gpu if gpu is not None else detect())
    _explicit = configs
    clear_cache()
    return configs


def reset() -> None:
    """Forget an explicitly loaded file and every cached lookup (tests; after changing DTUNE_CONFIG)."""
    global _explicit
    _explicit = None
    clear_cache()


def clear_cache() -> None:
    _loaded.clear()
    _cache.clear()


def _configs_for(gpu: str) -> TunedConfigs | None:
    if gpu in _loaded:
        return _loaded[gpu]
    found: TunedConfigs | None = None
    if _explicit is not None:
        if _explicit.gpu == gpu:
            found = _explicit
        else:
            warnings.warn(
                f"dtune: tuned configs {_explicit.source} are for {_explicit.gpu!r}, not this {gpu!r}: using defaults",
                RuntimeWarning,
                stacklevel=4,
            )
    elif env := os.environ.get(ENV):
        try:
            found = read_configs(env, gpu)
        except ConfigFileError as e:
            warnings.warn(f"dtune: {e}; using default configs", RuntimeWarning, stacklevel=4)
    else:
        found = shipped_configs(gpu, stacklevel=5)
    _loaded[gpu] = found
    return found


def configs_in_force(gpu: str) -> TunedConfigs | None:
    """The tuned configs the ops read on GPU ``gpu`` (its key): ``DTUNE_CONFIG``, else its shipped file over its kin's
    (:func:`kin_gpu`); None when there are none."""
    return _configs_for(gpu)


def shipped_configs(gpu: str, stacklevel: int = 2) -> TunedConfigs | None:
    """What dtune ships for GPU ``gpu`` (a key): its own file over its kin's (either may be missing; a corrupt one is
    left out, with a warning), None when there is neither. The ops' configs unless a file is given
    (:func:`load_configs`, ``DTUNE_CONFIG``)."""
    files: list[TunedConfigs] = []
    for key in (gpu, kin_gpu(gpu)):
        ref = resources.files("dtune.configs").joinpath(f"{key}.json") if key else None
        if ref is None or not ref.is_file():
            continue
        try:
            files.append(read_configs(str(ref), key))
        except ConfigFileError as e:
            warnings.warn(f"dtune: {e}; left out", RuntimeWarning, stacklevel=stacklevel)
    return overlay(*files) if len(files) == 2 else (files[0] if files else None)


def shipped_gpus() -> list[str]:
    """The GPU keys with a shipped tuned-config file (``dtune/configs/<gpu>.json``)."""
    return sorted(
        r.name[: -len(".json")] for r in resources.files("dtune.configs").iterdir() if r.name.endswith(".json")
    )


def kin_gpu(gpu: str) -> str | None:
    """The GPU whose shipped configs the ops read on ``gpu`` for the buckets its own shipped file lacks (all of them
    when it has none): another of the same kind (:func:`dtune.gpu.kin`: same compute capability, shared memory and
    registers, so its configs are legal here; an H100 reads the H200's). None when no other shipped file is of its
    kind."""
    from dtune.gpu import kin

    return kin(gpu, [g for g in shipped_gpus() if g != gpu])


def gpu_key(device: torch.device) -> str | None:
    """The GPU profile key of a CUDA ``device``; None when dtune has no profile for it, and for the CPU (Triton's
    interpreter: nothing is tuned for it)."""
    from dtune.gpu import detect

    if device.type != "cuda":
        return None

    return detect(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class SourceStatus:
    """One place tuned configs can come from, and what reading it gave (``dtune list`` prints these)."""

    origin: str  # "load_configs()", "DTUNE_CONFIG" or "shipped"
    path: str
    gpu: str | None = None  # the file's GPU key, when it loaded
    entries: int = 0
    error: str | None = None  # why it cannot be used (corrupt, unreadable, another GPU)
    active: bool = False  # the file the ops read on this machine's GPU
    kin: str | None = None  # active for this GPU although tuned on another of its kind (kin_gpu)
    under: str | None = None  # active, under this GPU's own file (which wins where both have a bucket)


def config_status(gpu: str | None) -> list[SourceStatus]:
    """Every source of tuned configs in lookup order, read and validated now, with the one in force on ``gpu`` (the
    detected GPU key; None without a CUDA GPU, where the ops run the templates' defaults) marked ``active``.

    ``DTUNE_CONFIG`` is read whatever the machine: a corrupt file is reported here even where no GPU would read it.
    """
    out: list[SourceStatus] = []
    if _explicit is not None:
        ok = gpu is not None and _explicit.gpu == gpu
        out.append(SourceStatus("load_configs()", _explicit.source, _explicit.gpu, len(_explicit.entries), None, ok))
    env = os.environ.get(ENV)
    if env:
        try:
            c = read_configs(env)
            error = None if gpu is None or c.gpu == gpu else f"is for GPU {c.gpu!r}, but this is {gpu!r}"
            out.append(SourceStatus(ENV, env, c.gpu, len(c.entries), error))
        except ConfigFileError as e:
            out.append(SourceStatus(ENV, env, error=str(e)))
    else:
        for ref in sorted(resources.files("dtune.configs").iterdir(), key=lambda r: r.name):
            if ref.name.endswith(".json"):
                try:
                    c = read_configs(str(ref))
                    out.append(SourceStatus("shipped", str(ref), c.gpu, len(c.entries)))
                except ConfigFileError as e:
                    out.append(SourceStatus("shipped", str(ref), error=str(e)))
    if gpu is not None and not (out and out[0].origin == "load_configs()"):
        # The first usable file for this GPU is in force (DTUNE_CONFIG hides the shipped files, as at run time); the
        # shipped file of a GPU of its kind (kin_gpu) too, under this GPU's own, or alone where none is shipped for it.
        kin = None if env else kin_gpu(gpu)
        own = next((i for i, st in enumerate(out) if st.error is None and st.gpu == gpu), None)
        if own is not None:
            out[own] = replace(out[own], active=True)
        if own is None or out[own].origin == "shipped":
            for i, st in enumerate(out):
                if st.error is None and st.origin == "shipped" and kin is not None and st.gpu == kin:
                    out[i] = replace(st, active=True, kin=kin, under=gpu if own is not None else None)
    return out


def tuned_choice(kernel: str, problem: Shape, dtype: torch.dtype, device: torch.device) -> Choice | None:
    """The tuned config for this kernel, GPU, dtype and shape, and where it came from (exact bucket, or borrowed and
    adjusted: :class:`dtune.borrow.Choice`); None for the template's default (no entry, no GPU, no file).

    A dict hit after the first call per (kernel, problem, dtype, device).
    """
    key = (kernel, problem, dtype, device.type, device.index)
    try:
        return _cache[key]
    except KeyError:
        pass
    gpu = gpu_key(device)
    configs = _configs_for(gpu) if gpu is not None else None
    found = configs.choose(kernel, dtype_name(dtype), problem) if configs is not None else None
    if len(_cache) >= CACHE_SIZE:
        del _cache[next(iter(_cache))]
    _cache[key] = found
    return found


def explain(kernel: str, problem: Shape, dtype: str, gpu: str) -> tuple[Choice | None, str | None]:
    """What the ops would run for ``kernel`` on ``problem`` on GPU ``gpu`` (its key): the choice (None: the
    template's default) and the tuned-config file in force for that GPU (None when there is none). For ``dtune list
    --shape``: the same file and rule as :func:`tuned_choice`, without a GPU present."""
    configs = _configs_for(gpu)
    if configs is None:
        return None, None
    return configs.choose(kernel, dtype, problem), configs.source


def tuned_config(kernel: str, problem: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, Any] | None:
    """The config of :func:`tuned_choice` (None: the default). Called on every op call: a dict hit after the first
    call per (kernel, problem, dtype, device)."""
    choice = tuned_choice(kernel, problem, dtype, device)
    return None if choice is None else choice.config
