"""Carry Triton's autotune results from one machine to another, so that a benchmark on a fresh machine does not
re-tune its baselines: fla's kernels autotune at their first call at each shape (1-3 minutes each on an H200, about
13 minutes for the six training steps of ``benchmarks/bwd_variants.py``), and Triton keeps the winners only in the
machine's own cache (``<cache dir>/<hash>/<kernel>.autotune.json``, with fla's ``FLA_CACHE_RESULTS=1``, its default).

Usage (from the checkout's root):
    python benchmarks/autotune_cache.py save OUT.tar.gz       after a run: every autotune result in the cache
    python benchmarks/autotune_cache.py restore IN.tar.gz     before a run on another machine (same image)
    python benchmarks/autotune_cache.py list                  what the cache holds

``--cache-dir DIR`` picks the cache (default: Triton's, ``$TRITON_CACHE_DIR`` or ``~/.triton/cache``). Only the
``*.autotune.json`` files travel (a few KB each; the compiled kernels stay behind and are rebuilt at the first call).
A result is found again only where its key matches: the same Triton build, GPU target, kernel source, environment
and tuning key (Triton hashes all of them into the folder name), so results from another Triton or GPU are carried
but never used. Restoring never overwrites a result the cache already has.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
from pathlib import Path

SUFFIX = ".autotune.json"


def default_cache_dir() -> Path:
    """Triton's cache folder: its knob where this Triton has one, else ``$TRITON_CACHE_DIR`` or ``~/.triton/cache``."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def results(cache: Path) -> list[Path]:
    """The autotune results in ``cache``, as paths relative to it (``<hash>/<kernel>.autotune.json``)."""
    if not cache.is_dir():
        return []
    return sorted(p.relative_to(cache) for p in cache.glob(f"*/*{SUFFIX}") if p.is_file())


def save(cache: Path, archive: Path) -> int:
    """Write every autotune result of ``cache`` into the gzipped tar ``archive``; the count."""
    found = results(cache)
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for rel in found:
            tar.add(cache / rel, arcname=str(rel))
    return len(found)


def restore(cache: Path, archive: Path) -> tuple[int, int]:
    """Extract the archive's autotune results into ``cache``: ``(added, already there)``. Anything else in the archive
    (another file name, a path leaving the folder, a file that is not JSON) is refused with a ValueError."""
    added = kept = 0
    with tarfile.open(archive, "r:*") as tar:
        members = [m for m in tar.getmembers() if not m.isdir()]
        for m in members:
            parts = Path(m.name).parts
            if not m.isfile() or len(parts) != 2 or ".." in parts or not m.name.endswith(SUFFIX):
                raise ValueError(f"{archive}: {m.name!r} is not an autotune result (<hash>/<kernel>{SUFFIX})")
        for m in members:
            dest = cache / m.name
            if dest.exists():
                kept += 1
                continue
            data = tar.extractfile(m)
            assert data is not None
            raw = data.read()
            try:
                json.load(io.BytesIO(raw))
            except ValueError as exc:
                raise ValueError(f"{archive}: {m.name} is not JSON ({exc})") from None
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_bytes(raw)
            tmp.replace(dest)  # atomic: a concurrent reader sees the whole file or none
            added += 1
    return added, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("action", choices=["save", "restore", "list"])
    ap.add_argument("archive", nargs="?", type=Path, help="the .tar.gz to write (save) or read (restore)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="Triton's cache folder (default: Triton's own)")
    args = ap.parse_args(argv)
    cache = args.cache_dir or default_cache_dir()
    if args.action == "list":
        for rel in results(cache):
            print(rel)
        print(f"{len(results(cache))} autotune result(s) in {cache}")
        return 0
    if args.archive is None:
        ap.error(f"{args.action} needs an archive path")
    if args.action == "save":
        print(f"saved {save(cache, args.archive)} autotune result(s) from {cache} to {args.archive}")
        return 0
    if not args.archive.is_file():
        print(f"autotune_cache: no archive at {args.archive}", file=sys.stderr)
        return 2
    try:
        added, kept = restore(cache, args.archive)
    except (ValueError, tarfile.TarError) as exc:
        print(f"autotune_cache: {exc}", file=sys.stderr)
        return 2
    print(f"restored {added} autotune result(s) into {cache} ({kept} already there)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
