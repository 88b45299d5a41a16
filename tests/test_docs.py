"""Every reference to the design document and the measured anchors names a file that exists (docs/DESIGN.md and
docs/anchors/...), in code, README, reports and the report the code writes; a LICENSE is there for pyproject's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".toml", ".html"}


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    files = out.stdout.split() if out.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    return [ROOT / f for f in files if Path(f).suffix in SUFFIXES and (ROOT / f).is_file()]


def test_design_and_anchor_references_resolve() -> None:
    bad: list[str] = []
    for path in tracked():
        if path.name.endswith(".log") or path == Path(__file__).resolve():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r"(?<![\w/.-])((?:docs/)?(?:DESIGN\.md|anchors/[\w.-]+\.md))", text):
            ref = m.group(1)
            if not ref.startswith("docs/"):
                bad.append(f"{path.relative_to(ROOT)}: '{ref}' (write docs/{ref})")
            elif not (ROOT / ref).is_file():
                bad.append(f"{path.relative_to(ROOT)}: '{ref}' does not exist")
        for m in re.finditer(r"docs/DESIGN\.md §(\d+)", text):
            design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
            if not re.search(rf"^## {m.group(1)}\. ", design, re.M):
                bad.append(f"{path.relative_to(ROOT)}: docs/DESIGN.md has no section {m.group(1)}")
    assert not bad, "\n".join(bad)


def test_license_file_matches_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'license = "MIT"' in pyproject and 'license-files = ["LICENSE"]' in pyproject
    assert "MIT License" in (ROOT / "LICENSE").read_text()
