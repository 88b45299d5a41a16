"""scripts/plant_bugs.py: every planted bug still applies to today's code, and a planted bug's tests are run on the
planted copy (caught), not on this checkout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "scripts" / "plant_bugs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plant_bugs"] = module
    spec.loader.exec_module(module)
    return module


plant_bugs = _script()


def test_every_bug_applies_once_and_names_existing_tests() -> None:
    bugs = plant_bugs.load_bugs()  # raises for a text not found exactly once
    assert len(bugs) >= 15
    for bug in bugs:
        assert bug.old != bug.new, bug.name
        for test in bug.tests:
            assert (ROOT / test.split("::")[0]).is_file(), f"{bug.name}: {test}"


def test_a_text_not_found_once_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "bugs.toml"
    data.write_text('[[mutant]]\nname = "x"\nfile = "dtune/ops.py"\nold = "no such text"\nnew = ""\ntests = []\n')
    with pytest.raises(ValueError, match="occurs 0 times"):
        plant_bugs.load_bugs(data)


def test_the_planted_copy_is_what_the_tests_see(tmp_path: Path) -> None:
    bug = next(b for b in plant_bugs.load_bugs() if "speedup inverted" in b.name)
    plant_bugs.copy_checkout(tmp_path)
    outcome = plant_bugs.plant(bug, tmp_path, workers=1, timeout=300)
    assert outcome.verdict == "caught", outcome
    assert "test_summary.py" in outcome.first_failure
    assert (tmp_path / bug.file).read_text() == (ROOT / bug.file).read_text()  # restored
