"""Merge a new tuning sitting's export into a shipped config file: the new entries replace the old ones of the
same kernel, dtype and shape bucket; every other old entry stays (dtune.export.supersede).

Usage:  python scripts/merge_configs.py dtune/configs/h200.json NEW.json [NEW2.json ...] --note "where from"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dtune, installed or not

from dtune.store import parse_configs
from dtune.tune.export import supersede


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shipped", type=Path)
    ap.add_argument("newer", type=Path, nargs="+")
    ap.add_argument("--note", required=True, help="where the new entries come from (kept in the file's note)")
    args = ap.parse_args()
    shipped = json.loads(args.shipped.read_text())
    merged, changes = supersede(shipped, [json.loads(p.read_text()) for p in args.newer], args.note)
    parse_configs(merged, str(args.shipped))  # the same checks as at run time: a bad merge never lands
    tmp = args.shipped.with_name(args.shipped.name + ".tmp")  # a reader never sees half a file
    tmp.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    tmp.replace(args.shipped)
    print("\n".join(changes) or "nothing new")


if __name__ == "__main__":
    main()
