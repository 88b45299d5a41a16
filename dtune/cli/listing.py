"""``dtune list``: kernels (forward and backward) and their search spaces, GPU profiles, shipped tuned configs (entries
per kernel, e.g. ``chunk_kda_bwd``'s, which the chunk ops' backward reads at run time)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Annotated, Any

import typer
from rich.table import Table

from dtune.cli.common import out


def inventory() -> dict[str, Any]:
    from dtune.gpu import profiles
    from dtune.kernels import KERNELS
    from dtune.store import ConfigFileError, read_configs
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
    return {"kernels": kernels, "gpus": gpus, "configs": sorted(configs, key=lambda c: c["file"])}


def list_(
    as_json: Annotated[bool, typer.Option("--json", help="Print the inventory as JSON.")] = False,
) -> None:
    """List the kernels (and their search spaces), the GPU profiles and the shipped tuned configs."""
    inv = inventory()
    if as_json:
        typer.echo(json.dumps(inv, indent=2))
        return
    t = Table(title="kernels")
    t.add_column("kernel", no_wrap=True, min_width=max(len(k["kernel"]) for k in inv["kernels"]))
    for col in ("family", "gate", "shipped", "search space"):
        t.add_column(col)
    for k in inv["kernels"]:
        s = k["space"]
        desc = "-" if s is None else s.get("error") or f"{s['size']} configs: " + ", ".join(s["params"])
        family = k["family"] + (" backward" if k["backward_of"] else "")
        t.add_row(k["kernel"], family, k["gate"], str(k["shipped_entries"]), desc)
    out.print(t)
    g = Table(title="GPU profiles (--gpu)")
    for col in ("key", "name", "cc", "SMs", "smem/block", "L2 MB", "HBM GB/s", "bf16 TF/s", "fp32 TF/s"):
        g.add_column(col)
    for p in inv["gpus"]:
        g.add_row(
            p["key"],
            p["name"],
            f"{p['cc_major']}.{p['cc_minor']}",
            str(p["sm_count"]),
            str(p["smem_per_block"]),
            f"{p['l2_mb']:g}",
            f"{p['hbm_gbs']:g}",
            f"{p['bf16_tflops']:g}",
            f"{p['fp32_tflops']:g}",
        )
    out.print(g)
    if inv["configs"]:
        for c in inv["configs"]:
            out.print(f"shipped configs {c['file']}: " + (c.get("error") or f"{c['gpu']}, {c['entries']} entries"))
    else:
        out.print("shipped configs: none yet (dtune/configs/<gpu>.json)")


def register(app: typer.Typer) -> None:
    app.command("list")(list_)
