"""``dtune list``: kernels (forward and backward) and their search spaces, GPU profiles, shipped tuned configs (entries
per kernel, e.g. ``chunk_kda_bwd``'s, which the chunk ops' backward reads at run time), and which tuned-config file the
ops read on this machine (a corrupt ``DTUNE_CONFIG`` is an error, exit 2, after the listing).

``dtune list --shape T16384-B2-H16-D64 [-k chunk_kda] [--gpu h200]``: instead, the config the ops would run for that
shape, per kernel, and where it comes from: its own tuned bucket (``exact``), the nearest buckets adjusted to the
shape (``borrowed``, with every change and why: :mod:`dtune.borrow`), or the template's default; for the ops that the
fla backend serves, what its speed rule decides there against fla's own path, forward and training step
(:mod:`dtune.integrations.speed_rule`)."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from dtune.cli.common import WIDE, fail, out


def inventory() -> dict[str, Any]:
    from dtune.gpu import detect, profiles
    from dtune.kernels import KERNELS
    from dtune.store import ConfigFileError, config_status, read_configs
    from dtune.tune import models as model_data
    from dtune.tune.space import SpaceError, load_space, shipped_spaces

    spaces = set(shipped_spaces())
    shipped: dict[str, int] = {}  # shipped tuned-config entries per kernel, all files
    configs = []
    for ref in resources.files("dtune.configs").iterdir():
        if ref.name.endswith(".json"):
            try:
                c = read_configs(str(ref))
                configs.append({"file": ref.name, "gpu": c.gpu, "entries": len(c.entries)})
                for e in c.entries:
                    shipped[e.kernel] = shipped.get(e.kernel, 0) + 1
            except ConfigFileError as e:
                configs.append({"file": ref.name, "error": str(e)})
    kernels = []
    for name, spec in KERNELS.items():
        row: dict[str, Any] = {
            "kernel": name,
            "family": spec.family,
            "gate": spec.gate,
            "backward_of": spec.forward_kernel if spec.backward else None,
            "shipped_entries": shipped.get(name, 0),
            "space": None,
        }
        if name in spaces:
            try:
                s = load_space(name)
                row["space"] = {"params": {k: list(v) for k, v in s.params.items()}, "size": s.size()}
            except SpaceError as e:
                row["space"] = {"error": str(e)}
        kernels.append(row)
    gpus = [p.as_dict() for p in profiles().values()]
    data = model_data.load()
    models = [
        {"model": m.name, "family": m.family, "heads": m.heads, "v_heads": m.v_heads, "head_dim": m.head_dim,
         "tensor_parallel": list(data.calls.tensor_parallel)}
        for m in data.models.values()
    ]  # fmt: skip
    gpu = detect()
    status = [dataclasses.asdict(st) for st in config_status(gpu)]
    return {
        "kernels": kernels,
        "gpus": gpus,
        "models": models,
        "configs": sorted(configs, key=lambda c: c["file"]),
        "gpu_detected": gpu,
        "config_sources": status,
    }


def _source_line(st: dict[str, Any]) -> str:
    where = f"{st['origin']} {st['path']}" if st["origin"] != "shipped" else f"shipped {Path(st['path']).name}"
    if st["error"] and st["gpu"] is None:
        return f"{where}: NOT loaded: {st['error']}"
    loaded = f"loaded, {st['gpu']}, {st['entries']} entr{'y' if st['entries'] == 1 else 'ies'}"
    if st["error"]:
        return f"{where}: {loaded}, but NOT used: {st['error']}"
    if st.get("kin") and st.get("under"):
        return f"{where}: {loaded} (in force where {st['under']}.json has no entry: {st['kin']} is of its kind)"
    if st.get("kin"):
        return f"{where}: {loaded} (in force: none is shipped for this GPU, and {st['kin']} is of its kind)"
    return f"{where}: {loaded}" + (" (in force)" if st["active"] else "")


def print_config_sources(inv: dict[str, Any]) -> None:
    """Which tuned-config file the ops read here, and what reading each source gave."""
    gpu = inv["gpu_detected"]
    here = f"this machine's GPU: {gpu}" if gpu else "no CUDA GPU here: the ops run the templates' default configs"
    out.print(f"tuned configs ({here}; lookup order: load_configs(), $DTUNE_CONFIG, shipped):", highlight=False)
    for st in inv["config_sources"]:
        out.print(f"  {escape(_source_line(st))}", highlight=False, soft_wrap=True)
    if gpu and not any(st["active"] for st in inv["config_sources"]):
        out.print(f"  none in force for {gpu}: the ops use the templates' default configs", highlight=False)


ENV = "DTUNE_CONFIG"
SHAPE_KEYS = {"T", "B", "H", "HV", "K", "V", "D", "N"}


def parse_shape(text: str) -> dict[str, int]:
    """``T16384-B2-H16-D64`` (also ``HV32``, ``K128-V64``, ``N16`` for 16 packed sequences of T tokens in all) as
    ``B, T, H, HV, K, V, N, varlen``; ValueError naming the problem. Defaults: B = 1, H = 16, HV = H, K = V = 128."""
    import re

    parts: dict[str, int] = {}
    for token in re.split(r"[-,\s]+", text.strip()):
        m = re.fullmatch(r"(HV|[A-Z])(\d+)", token.upper())
        if not token or m is None or m.group(1) not in SHAPE_KEYS or int(m.group(2)) < 1:
            raise ValueError(
                f"--shape {text!r}: cannot read {token!r} (write e.g. T16384-B2-H16-D64; keys {sorted(SHAPE_KEYS)})"
            )
        parts[m.group(1)] = int(m.group(2))
    if "T" not in parts:
        raise ValueError(f"--shape {text!r}: needs the sequence length, e.g. T4096")
    if "D" in parts:
        parts.setdefault("K", parts["D"])
        parts.setdefault("V", parts["D"])
    H = parts.get("H", 16)
    packed = "N" in parts
    if packed and parts.get("B", 1) != 1:
        raise ValueError(f"--shape {text!r}: a packed batch (N sequences) has B = 1")
    shape = {"T": parts["T"], "B": parts.get("B", 1), "H": H, "HV": parts.get("HV", H)}
    shape |= {"K": parts.get("K", 128), "V": parts.get("V", 128), "N": parts.get("N", parts.get("B", 1))}
    if shape["HV"] % H:
        raise ValueError(f"--shape {text!r}: HV={shape['HV']} is not a multiple of H={H}")
    return {**shape, "varlen": int(packed)}


def lookups(shape_text: str, kernels: list[str], gpu: str | None, dtype: str) -> list[dict[str, Any]]:
    """The lookup of every kernel in ``kernels`` for the shape on ``gpu`` (see the module's docstring)."""
    from dtune.integrations.fla_calls import KERNEL_OF
    from dtune.integrations.speed_rule import speed_verdict
    from dtune.kernels import get_kernel
    from dtune.shape import Gate, Shape
    from dtune.store import configs_in_force, explain

    d = parse_shape(shape_text)
    configs = configs_in_force(gpu) if gpu else None
    rows = []
    for kernel in kernels:
        spec = get_kernel(kernel)
        p = Shape(d["B"], d["T"], d["H"], d["HV"], d["K"], d["V"], d["N"], Gate(spec.gate), bool(d["varlen"]))
        choice, source = explain(spec.name, p, dtype, gpu) if gpu else (None, None)
        fla: dict[str, str] = {}  # the fla backend's speed rule against fla's own path, for the ops it serves
        if spec.name in KERNEL_OF.values():
            for mode, grad in (("forward", False), ("training step", True)):
                if grad and not spec.backward_kernel:
                    continue
                ok, why = speed_verdict(configs, spec.name, p, dtype, "fla", grad)
                fla[mode] = "dtune" if ok else f"fla: {why}"
        rows.append(
            {
                "kernel": spec.name,
                "shape": p.key + (f" ({p.N} packed)" if p.varlen else ""),
                "bucket": p.lookup_bucket(),
                "match": choice.match if choice else "default",
                "source": source,
                "from": choice.describe() if choice else (f"no {dtype} entry in {Path(source).name}" if source else ""),
                "changes": [str(c) for c in choice.changes] if choice else [],
                "config": choice.config if choice else None,
                "fla_backend": fla,
            }
        )
    return rows


def list_(
    as_json: Annotated[bool, typer.Option("--json", help="Print the inventory as JSON.")] = False,
    shape: Annotated[
        str | None,
        typer.Option(
            "--shape",
            help="Instead: which config the ops run for this shape (e.g. T16384-B2-H16-D64; HV32, K128-V64, N16 for 16 "
            "packed sequences) and where it comes from: its tuned bucket, borrowed and adjusted, or the default.",
        ),
    ] = None,
    kernel: Annotated[
        str | None, typer.Option("--kernel", "-k", help="With --shape: kernels, comma-separated (default: all).")
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="With --shape: the GPU whose tuned configs to read (default: the one present)."),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="With --shape: bf16, fp16 or fp32.")] = "bf16",
) -> None:
    """List the kernels (and their search spaces), the GPU profiles and the shipped tuned configs; with --shape, the
    config the ops run for a shape and where it comes from."""
    if shape is not None:
        _print_lookups(shape, kernel, gpu, dtype, as_json)
        return
    inv = inventory()
    broken = [st for st in inv["config_sources"] if st["origin"] == ENV and st["gpu"] is None]
    if as_json:
        typer.echo(json.dumps(inv, indent=2))
        if broken:
            fail(f"{ENV}={broken[0]['path']}: {broken[0]['error']}")
        return
    wide = out.width >= WIDE
    t = Table(title="kernels")
    t.add_column("kernel", no_wrap=True)
    if wide:
        t.add_column("family", no_wrap=True)
    t.add_column("gate", no_wrap=True)
    t.add_column("shipped", no_wrap=True)
    t.add_column("search space (configs: parameters)")
    for k in inv["kernels"]:
        s = k["space"]
        desc = "-" if s is None else s.get("error") or f"{s['size']}: " + ", ".join(s["params"])
        family = k["family"] + (" backward" if k["backward_of"] else "")
        t.add_row(k["kernel"], *([family] if wide else []), k["gate"], str(k["shipped_entries"]), desc)
    out.print(t)
    g = Table(title="GPU profiles (--gpu)")
    cols = ("key", "name", "cc", "SMs", "smem KiB", "L2 MB", "HBM GB/s", "bf16 TFLOP/s", "fp32 TFLOP/s")
    for col in cols if wide else (c for c in cols if c != "name"):
        g.add_column(col, no_wrap=col == "key", justify="left" if col in ("key", "name") else "right")
    for p in inv["gpus"]:
        g.add_row(
            p["key"],
            *([p["name"]] if wide else []),
            f"{p['cc_major']}.{p['cc_minor']}",
            str(p["sm_count"]),
            f"{p['smem_per_block'] / 1024:g}",
            f"{p['l2_mb']:g}",
            f"{p['hbm_gbs']:g}",
            f"{p['bf16_tflops']:g}",
            f"{p['fp32_tflops']:g}",
        )
    out.print(g)
    m = Table(title="models (dtune tune-gpu --models; dtune/models.toml)")
    for col in ("model", "family", "heads", "v heads", "D", "TP degrees"):  # fits 80 columns
        m.add_column(col, no_wrap=col in ("model", "family"))
    for row in inv["models"]:
        m.add_row(row["model"], row["family"], str(row["heads"]), str(row["v_heads"]), str(row["head_dim"]),
                  ", ".join(map(str, row["tensor_parallel"])))  # fmt: skip
    out.print(m)
    if inv["configs"]:
        for c in inv["configs"]:
            out.print(f"shipped configs {c['file']}: " + (c.get("error") or f"{c['gpu']}, {c['entries']} entries"))
    else:
        out.print("shipped configs: none yet (dtune/configs/<gpu>.json)")
    print_config_sources(inv)
    if broken:
        fail(f"{ENV}={broken[0]['path']}: {broken[0]['error']}")


def _print_lookups(shape: str, kernel: str | None, gpu: str | None, dtype: str, as_json: bool) -> None:
    from dtune.gpu import GpuError, detect, get_profile
    from dtune.inputs import DTYPE_NAMES
    from dtune.kernels import KERNELS

    if dtype not in DTYPE_NAMES:
        fail(f"--dtype {dtype!r}: choose from {', '.join(DTYPE_NAMES)}")
    names = [k.strip() for k in kernel.split(",") if k.strip()] if kernel else list(KERNELS)
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        fail(f"unknown kernel(s) {unknown}; known: {', '.join(KERNELS)}")
    try:
        key = get_profile(gpu).key if gpu else detect()
        rows = lookups(shape, names, key, dtype)
    except (GpuError, ValueError) as e:
        fail(str(e))
    if as_json:
        typer.echo(json.dumps({"gpu": key, "dtype": dtype, "lookups": rows}, indent=2))
        return
    where = f"GPU {key}" if key else "no CUDA GPU here (name one with --gpu): the ops run the templates' defaults"
    out.print(f"{escape(shape)}, {dtype}, {where}:", highlight=False)
    for r in rows:
        text = r["from"] if r["match"] != "default" else f"default ({r['from'] or 'no tuned-config file'})"
        out.print(f"  {r['kernel']}: {escape(text)}", highlight=False, soft_wrap=True)
        for mode, verdict in r["fla_backend"].items():
            out.print(f"    fla backend, {mode} (against fla's own path): {escape(verdict)}", highlight=False,
                      soft_wrap=True)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("list")(list_)
