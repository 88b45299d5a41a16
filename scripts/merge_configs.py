"""Merge a new tuning sitting's export into a shipped config file: the new entries replace the old ones of the
same kernel, dtype and shape bucket; every other old entry stays.

Unlike `dtune export` over several run folders (fastest entry wins), a newer sitting supersedes an older one here:
its search timed the old best config too (it is the template's default, or the seed), and times from different
sittings are not comparable.

Usage:  python scripts/merge_configs.py dtune/configs/h200.json NEW.json [NEW2.json ...] --note "where from"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dtune.runinfo import now_iso
from dtune.store import parse_configs


def _key(entry: dict[str, Any]) -> str:
    return json.dumps([entry["kernel"], entry["dtype"], entry["bucket"]], sort_keys=True)


def merge(shipped: dict[str, Any], newer: list[dict[str, Any]], note: str) -> tuple[dict[str, Any], list[str]]:
    """The merged document and one line per entry added or replaced."""
    entries = {_key(e): e for e in shipped["entries"]}
    changes = []
    for doc in newer:
        if doc["gpu"] != shipped["gpu"]:
            raise SystemExit(f"cannot merge a {doc['gpu']} export into the {shipped['gpu']} configs")
        for e in doc["entries"]:
            if e.get("time_ms") is None:
                continue
            old = entries.get(_key(e))
            was = "new" if old is None else f"was {old['time_ms']:.4g} ms in its own sitting"
            changes.append(f"{e['kernel']} {e['dtype']} {e['bucket']}: {e['time_ms']:.4g} ms ({was})")
            entries[_key(e)] = e
    out = {**shipped, "created": now_iso(), "versions": newer[-1].get("versions", shipped.get("versions", {}))}
    out["note"] = f"{shipped.get('note', '')}; {note}".strip("; ")
    out["entries"] = sorted(entries.values(), key=lambda e: _key(e))
    return out, changes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shipped", type=Path)
    ap.add_argument("newer", type=Path, nargs="+")
    ap.add_argument("--note", required=True, help="where the new entries come from (kept in the file's note)")
    args = ap.parse_args()
    shipped = json.loads(args.shipped.read_text())
    merged, changes = merge(shipped, [json.loads(p.read_text()) for p in args.newer], args.note)
    parse_configs(merged, str(args.shipped))  # the same checks as at run time: a bad merge never lands
    args.shipped.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    print("\n".join(changes) or "nothing new")


if __name__ == "__main__":
    main()
