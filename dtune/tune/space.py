"""Search spaces (``search_spaces/<kernel>.toml``): parameters and their choices, constraints, seeds, gate
tolerances and the default shape grid of one tunable kernel. Data, not code: loaded and validated here.

``[tune]`` (optional) says what ``dtune tune-gpu`` tunes of the kernel on a new GPU (:mod:`dtune.tune.grid`): the anchor
bucket tuned first on the whole budget, whether the ``[shapes]`` grid follows, the buckets beyond it (long prompts,
grouped value heads, a packed batch) and each bucket's share of the job's budget (:class:`TuneSpec`).

``[accuracy]`` (optional, per dtype): the most a config's error may be, as a multiple of the template default's on the
same inputs (the gate's accuracy criterion, :mod:`dtune.tune.gate`): ``bf16 = 1.15`` fails a bf16 config whose error
of any output is more than 1.15 times the default's, however far inside ``[tolerance]`` it is.

``[stages]`` (optional) splits the parameters by the launches they shape, for the stage-wise search
(:mod:`dtune.tune.stages`): ``name = { params = [...], launches = [...] }`` names a stage's own parameters and the
launches (the template's ``plan()`` stage names) whose time is that stage's time; every parameter no stage lists
couples the stages. Data, so a new kernel family (a backward, a new launch) only needs its space file.

Constraints are Python expressions over the parameters, the shape (B, T, H, HV, K, V, N) and the GPU's
limits (smem_per_block, sm_count, cc_major, cc_minor, regs_per_sm), with ``next_power_of_2``, ``min`` and
``max``. They are checked by walking their syntax tree (only arithmetic, comparisons, boolean logic,
conditional expressions and those three calls) and evaluated without builtins.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dtune.kernels import get_kernel
from dtune.kernels.config import next_power_of_2

from dtune import _toml
from dtune.errors import FileProblem
from dtune.inputs import DTYPE_NAMES
from dtune.shape import Shape, ShapeGrid
from dtune.tune.stages import StageMap, StageSpec

SHAPE_NAMES = ("B", "T", "H", "HV", "K", "V", "N")
GPU_NAMES = ("smem_per_block", "sm_count", "cc_major", "cc_minor", "regs_per_sm")
FUNCTIONS: dict[str, Any] = {"next_power_of_2": next_power_of_2, "min": min, "max": max}

_ALLOWED_NODES: tuple[type[ast.AST], ...] = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.IfExp,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
)


class SpaceError(FileProblem):
    """A search-space file that cannot be used: the message names the file and the problem."""


@dataclass(frozen=True)
class Constraint:
    name: str
    expression: str
    code: Any = field(repr=False, compare=False)

    def holds(self, names: Mapping[str, Any]) -> bool:
        return bool(eval(self.code, {"__builtins__": {}, **FUNCTIONS}, dict(names)))


@dataclass(frozen=True)
class ExtraBucket:
    """A bucket ``dtune tune-gpu`` tunes beyond the grid, at the anchor's head dim and heads."""

    T: int
    B: int
    hv_ratio: int = 1


@dataclass(frozen=True)
class RunCosts:
    """What a ``dtune tune-gpu`` search costs beyond its buckets' budgets (seconds; the job's estimate). The defaults
    are the chunk kernels', measured on the H200 (tune-gpu --budget 30, 14 compile workers, 27 buckets of DeltaNet and
    Gated DeltaNet in 614 s against 310 s of budgets): start-up and the export 7-11 s a run, the end of a bucket
    (trials in flight, its records) about 9 s, and a bucket runs on past a budget shorter than its first answers (the
    default and the transferred configs, search.tune_shape): about 20 s of compiles on a cold cache. A space sets its
    own in ``[tune] costs`` (the fused-recurrent kernels: seconds, not tens of seconds)."""

    run_start_s: float = 10.0  # start-up and the export, once per search
    bucket_end_s: float = 9.0  # the end of a bucket: trials in flight, its records
    starts_s: float = 20.0  # the first answers (the default and the transferred configs): a shorter budget runs on


@dataclass(frozen=True)
class TuneSpec:
    """``[tune]``: what ``dtune tune-gpu`` tunes of this kernel (defaults: the grid's middle bucket as anchor, then the
    grid, each bucket on a third of the budget)."""

    anchor: dict[str, int] = field(default_factory=dict)  # T, D and optionally B, H; {}: the grid's middle bucket
    grid: bool = True  # tune the [shapes] grid after the anchor (False: the anchor and the extra buckets only)
    extra: tuple[ExtraBucket, ...] = ()
    packed_seqs: tuple[int, ...] = ()  # one packed batch of these sequence lengths (cu_seqlens), anchor's D and H
    anchor_share: float = 1.0  # of the job's --budget, for the anchor
    bucket_share: float = 1 / 3  # of the job's --budget, for every other bucket
    costs: RunCosts = field(default_factory=RunCosts)  # measured overheads of this kernel's searches


@dataclass(frozen=True)
class SearchSpace:
    kernel: str
    description: str
    params: dict[str, tuple[Any, ...]]
    constraints: tuple[Constraint, ...]
    seeds: tuple[dict[str, Any], ...]
    tolerance: dict[str, float]
    shapes: ShapeGrid
    source: str
    stages: StageMap = field(default_factory=StageMap)
    tune: TuneSpec = field(default_factory=TuneSpec)
    accuracy: dict[str, float] = field(default_factory=dict)  # dtype: the most error as a multiple of the default's

    def violations(self, config: Mapping[str, Any], shape: Shape, gpu: Mapping[str, int]) -> list[str]:
        """Names of the constraints that ``config`` (a full config) breaks at ``shape`` on ``gpu``."""
        names = {**gpu, **shape.names(), **config}
        return [c.name for c in self.constraints if not c.holds(names)]

    def size(self) -> int:
        return math.prod(len(v) for v in self.params.values())


def _fail(source: str, message: str) -> SpaceError:
    return SpaceError(f"search space {source}: {message}")


def compile_constraint(name: str, expression: str, known: set[str], source: str = "<space>") -> Constraint:
    """Parse and check one constraint: only safe syntax, only known names; SpaceError otherwise."""
    if not isinstance(expression, str) or not expression.strip():
        raise _fail(source, f"constraint {name!r} must be a non-empty expression string")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise _fail(source, f"constraint {name!r} is not a valid expression: {expression!r} ({e.msg})") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise _fail(source, f"constraint {name!r} uses {type(node).__name__}, which is not allowed: {expression!r}")
        if isinstance(node, ast.Call) and (
            not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords
        ):
            raise _fail(
                source,
                f"constraint {name!r}: only {', '.join(FUNCTIONS)} may be called (positional arguments): "
                f"{expression!r}",
            )
        if isinstance(node, ast.Name) and node.id not in known and node.id not in FUNCTIONS:
            raise _fail(
                source, f"constraint {name!r} names unknown {node.id!r}; known names: {', '.join(sorted(known))}"
            )
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool, str)):
            raise _fail(
                source, f"constraint {name!r}: only numbers and strings may appear as constants: {expression!r}"
            )
    return Constraint(name, expression, compile(tree, f"<constraint {name}>", "eval"))


def _int_list(source: str, section: str, key: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value)
    ):
        raise _fail(source, f"[{section}] {key} must be a non-empty list of positive integers, got {value!r}")
    return tuple(value)


def _unknown_param(name: str, kernel: str, legal: list[str]) -> str:
    """The error for a [params] name the kernel's template lacks, naming the kernels whose template has it (a space
    written for another kernel is the usual cause)."""
    from dtune.kernels import KERNELS

    owners = sorted(k for k, spec in KERNELS.items() if name in spec.legal_params())
    hint = (
        f"; {name!r} is a parameter of {', '.join(owners)}: was this space written for another kernel?"
        if owners
        else ""
    )
    return f"[params] {name!r} is not a parameter of the {kernel} template (its parameters: {', '.join(legal)}){hint}"


def parse_space(data: Mapping[str, Any], source: str = "<space>") -> SearchSpace:
    """Validate a parsed space file against its kernel's template; SpaceError naming the problem otherwise."""
    known_top = {
        "kernel",
        "description",
        "params",
        "constraints",
        "seeds",
        "tolerance",
        "accuracy",
        "shapes",
        "stages",
        "tune",
    }
    extra = sorted(set(data) - known_top)
    if extra:
        raise _fail(source, f"unknown section(s) {extra}; expected {sorted(known_top)}")
    kernel_name = data.get("kernel")
    if not isinstance(kernel_name, str):
        raise _fail(source, 'missing `kernel = "<name>"`')
    try:
        spec = get_kernel(kernel_name)
    except ValueError as e:
        raise _fail(source, str(e)) from None
    legal = spec.legal_params()

    raw_params = data.get("params")
    if not isinstance(raw_params, dict) or not raw_params:
        raise _fail(source, "empty search space: [params] must name at least one parameter")
    params: dict[str, tuple[Any, ...]] = {}
    for name, choices in raw_params.items():
        if name not in legal:
            raise _fail(source, _unknown_param(name, kernel_name, sorted(legal)))
        if not isinstance(choices, list) or not choices:
            raise _fail(source, f"parameter {name!r} must be a non-empty list of choices, got {choices!r}")
        for value in choices:
            if value not in legal[name] or isinstance(value, bool) != isinstance(legal[name][0], bool):
                raise _fail(
                    source, f"{name} = {value!r} is not legal for the {kernel_name} template: legal {list(legal[name])}"
                )
        if len(set(choices)) != len(choices):
            raise _fail(source, f"parameter {name!r} lists a choice twice: {choices!r}")
        params[name] = tuple(choices)

    known = set(legal) | set(SHAPE_NAMES) | set(GPU_NAMES)
    raw_constraints = data.get("constraints", {})
    if not isinstance(raw_constraints, dict):
        raise _fail(source, '[constraints] must be a table of name = "expression"')
    constraints = tuple(compile_constraint(n, e, known, source) for n, e in raw_constraints.items())

    seeds: list[dict[str, Any]] = []
    raw_seeds = data.get("seeds", {})
    for i, cfg in enumerate(raw_seeds.get("configs", []) if isinstance(raw_seeds, dict) else [None]):
        if not isinstance(cfg, dict):
            raise _fail(source, f"[seeds] configs[{i}] must be an inline table of parameters")
        for name, value in cfg.items():
            if name not in params:
                raise _fail(source, f"[seeds] configs[{i}] sets {name!r}, which is not a parameter of the space")
            if value not in params[name]:
                raise _fail(
                    source, f"[seeds] configs[{i}]: {name} = {value!r} is not among the choices {list(params[name])}"
                )
        seeds.append(dict(cfg))

    raw_tol = data.get("tolerance")
    if not isinstance(raw_tol, dict):
        raise _fail(source, "missing [tolerance] (relative RMS error per dtype: fp32, fp16, bf16)")
    missing = [d for d in DTYPE_NAMES if d not in raw_tol]
    if missing:
        raise _fail(source, f"[tolerance] lacks {missing}")
    tolerance: dict[str, float] = {}
    for d, tol in raw_tol.items():
        if d not in DTYPE_NAMES:
            raise _fail(source, f"[tolerance] names unknown dtype {d!r}; use {', '.join(DTYPE_NAMES)}")
        if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not 0 < tol < 1:
            raise _fail(source, f"[tolerance] {d} must be a number in (0, 1), got {tol!r}")
        tolerance[d] = float(tol)
    accuracy = _parse_accuracy(source, data.get("accuracy", {}))

    raw_shapes = data.get("shapes")
    if not isinstance(raw_shapes, dict):
        raise _fail(source, "missing [shapes] (seq_lens, head_dims, heads, and batch or batch_tokens)")
    unknown_shape = sorted(set(raw_shapes) - {"seq_lens", "head_dims", "heads", "batch", "batch_tokens"})
    if unknown_shape:
        raise _fail(source, f"[shapes] has unknown key(s) {unknown_shape}")
    for key in ("seq_lens", "head_dims", "heads"):
        if key not in raw_shapes:
            raise _fail(source, f"[shapes] lacks {key}")
    if ("batch" in raw_shapes) == ("batch_tokens" in raw_shapes):
        raise _fail(source, "[shapes] needs exactly one of batch (list) or batch_tokens (B = batch_tokens // T)")
    batch_tokens = raw_shapes.get("batch_tokens")
    if batch_tokens is not None and (not isinstance(batch_tokens, int) or batch_tokens < 1):
        raise _fail(source, f"[shapes] batch_tokens must be a positive integer, got {batch_tokens!r}")
    grid = ShapeGrid(
        seq_lens=_int_list(source, "shapes", "seq_lens", raw_shapes["seq_lens"]),
        head_dims=_int_list(source, "shapes", "head_dims", raw_shapes["head_dims"]),
        heads=_int_list(source, "shapes", "heads", raw_shapes["heads"]),
        batch=_int_list(source, "shapes", "batch", raw_shapes["batch"]) if "batch" in raw_shapes else (),
        batch_tokens=batch_tokens,
    )
    stages = _parse_stages(source, data.get("stages", {}), params)
    description = data.get("description", "")
    return SearchSpace(
        kernel=kernel_name,
        description=str(description),
        params=params,
        constraints=constraints,
        seeds=tuple(seeds),
        tolerance=tolerance,
        shapes=grid,
        source=source,
        stages=stages,
        tune=_parse_tune(source, data.get("tune", {})),
        accuracy=accuracy,
    )


def _positive_int(source: str, where: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(source, f"[tune] {where} must be a positive integer, got {value!r}")
    return value


def _parse_tune(source: str, raw: Any) -> TuneSpec:
    """``[tune]``: ``anchor = { T, D[, B, H] }``, ``grid``, ``extra = [{ T, B[, hv_ratio] }, ...]``, ``packed_seqs``,
    ``anchor_share`` and ``bucket_share`` (fractions of the job's budget, in (0, 10]), ``costs = { run_start_s,
    bucket_end_s, starts_s }`` (seconds, each optional: :class:`RunCosts`)."""
    if not isinstance(raw, dict):
        raise _fail(source, "[tune] must be a table")
    unknown = sorted(set(raw) - {"anchor", "grid", "extra", "packed_seqs", "anchor_share", "bucket_share", "costs"})
    if unknown:
        raise _fail(source, f"[tune] has unknown key(s) {unknown}")
    anchor = raw.get("anchor", {})
    if not isinstance(anchor, dict) or (anchor and not {"T", "D"} <= set(anchor)) or set(anchor) - {"T", "D", "B", "H"}:
        raise _fail(source, f"[tune] anchor must be {{ T = ..., D = ... }} (B and H optional), got {anchor!r}")
    anchor = {k: _positive_int(source, f"anchor.{k}", v) for k, v in anchor.items()}
    grid = raw.get("grid", True)
    if not isinstance(grid, bool):
        raise _fail(source, f"[tune] grid must be true or false, got {grid!r}")
    extra = []
    for i, e in enumerate(raw.get("extra", [])):
        if not isinstance(e, dict) or not {"T", "B"} <= set(e) or set(e) - {"T", "B", "hv_ratio"}:
            raise _fail(source, f"[tune] extra[{i}] must be {{ T = ..., B = ... }} (hv_ratio optional), got {e!r}")
        extra.append(ExtraBucket(**{k: _positive_int(source, f"extra[{i}].{k}", v) for k, v in e.items()}))
    packed = raw.get("packed_seqs", [])
    packed = _int_list(source, "tune", "packed_seqs", packed) if packed != [] else ()
    shares = {}
    for key in ("anchor_share", "bucket_share"):
        value = raw.get(key, getattr(TuneSpec, key))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 10:
            raise _fail(source, f"[tune] {key} must be a number in (0, 10] (a share of the budget), got {value!r}")
        shares[key] = float(value)
    costs = raw.get("costs", {})
    names = {f.name for f in dataclasses.fields(RunCosts)}
    if not isinstance(costs, dict) or set(costs) - names:
        raise _fail(source, f"[tune] costs must be a table of {', '.join(sorted(names))}, got {costs!r}")
    for key, value in costs.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 3600:
            raise _fail(source, f"[tune] costs.{key} must be seconds in [0, 3600), got {value!r}")
    run_costs = RunCosts(**{k: float(v) for k, v in costs.items()})
    return TuneSpec(anchor, grid, tuple(extra), packed, **shares, costs=run_costs)


def _parse_accuracy(source: str, raw: Any) -> dict[str, float]:
    """``[accuracy]``: per dtype, a ratio of at least 1 (the default passes its own criterion)."""
    if not isinstance(raw, dict):
        raise _fail(source, "[accuracy] must be a table of dtype = ratio (e.g. bf16 = 1.15)")
    out: dict[str, float] = {}
    for d, ratio in raw.items():
        if d not in DTYPE_NAMES:
            raise _fail(source, f"[accuracy] names unknown dtype {d!r}; use {', '.join(DTYPE_NAMES)}")
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 1 <= ratio < math.inf:
            raise _fail(source, f"[accuracy] {d} must be a ratio of at least 1 (of the default's error), got {ratio!r}")
        out[d] = float(ratio)
    return out


def _parse_stages(source: str, raw: Any, params: Mapping[str, Any]) -> StageMap:
    """``[stages]``: each stage's own parameters (each in at most one stage) and the launches it times."""
    if not isinstance(raw, dict):
        raise _fail(source, "[stages] must be a table of name = { params = [...], launches = [...] }")
    specs: list[StageSpec] = []
    owner: dict[str, str] = {}
    launch_owner: dict[str, str] = {}
    for name, body in raw.items():
        if not isinstance(body, dict) or set(body) - {"params", "launches"}:
            raise _fail(source, f"[stages] {name} must be a table with `params` and optionally `launches`")
        names = body.get("params")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise _fail(source, f"[stages] {name}.params must be a non-empty list of parameter names")
        for n in names:
            if n not in params:
                raise _fail(source, f"[stages] {name} lists {n!r}, which is not a parameter of the space")
            if n in owner:
                raise _fail(source, f"[stages] {n!r} is listed by both {owner[n]!r} and {name!r}")
            owner[n] = name
        launches = body.get("launches", [name])
        if not isinstance(launches, list) or not launches or not all(isinstance(x, str) for x in launches):
            raise _fail(source, f"[stages] {name}.launches must be a non-empty list of launch names")
        for x in launches:
            if x in launch_owner:
                raise _fail(source, f"[stages] launch {x!r} is claimed by both {launch_owner[x]!r} and {name!r}")
            launch_owner[x] = name
        specs.append(StageSpec(str(name), tuple(names), tuple(launches)))
    return StageMap(tuple(specs))


def load_space_file(path: str | Path) -> SearchSpace:
    """A user's own space file (``--space FILE``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpaceError(f"search space {path}: cannot read it ({e.strerror})") from None
    return _parse_text(text, str(path))


def _parse_text(text: str, source: str) -> SearchSpace:
    try:
        data = _toml.loads(text)
    except _toml.TOMLDecodeError as e:
        raise _fail(source, f"not valid TOML ({e})") from None
    return parse_space(data, source)


def shipped_spaces() -> list[str]:
    """Kernel names that have a search space shipped in ``dtune.search_spaces``."""
    root = resources.files("dtune.search_spaces")
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_space(kernel: str) -> SearchSpace:
    """The shipped space of ``kernel``; SpaceError if the kernel has none."""
    get_kernel(kernel)  # unknown kernel: ValueError naming the known ones
    ref = resources.files("dtune.search_spaces").joinpath(f"{kernel}.toml")
    if not ref.is_file():
        raise SpaceError(f"kernel {kernel!r} has no shipped search space; shipped: {', '.join(shipped_spaces())}")
    space = _parse_text(ref.read_text(encoding="utf-8"), f"dtune.search_spaces/{kernel}.toml")
    if space.kernel != kernel:
        raise SpaceError(f"search space {space.source} is for {space.kernel!r}, not {kernel!r}")
    return space
