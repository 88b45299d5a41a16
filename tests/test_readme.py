"""The README's and docs' commands still run and their example outputs are today's.

- An example is a ```console block right after a ``<!-- example: columns=N -->`` line: its ``$ dtune ...`` command
  runs here in a fresh folder, N columns wide (one that runs kernels says ``--interpret``), and its stdout must
  match the block's once the measured values are masked (times, rates, ratios: every number with a decimal point
  or a unit; the values of a config's NAME=VALUE pairs, since timings pick the config) and the layout is folded
  (white space, line breaks, table rules): the columns, rows, labels and counts must be the same.
  ``python tests/test_readme.py --write`` rewrites every example with a fresh run's output.
- Every ``dtune ...`` command in a bash or console block parses (the command exists, its options and their values
  are valid); every ``python benchmarks/*.py`` / ``scripts/*`` command names a file that exists, and the options it
  passes are ones the script's ``--help`` lists.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "reports").glob("*/README.md"))]
MARKER = re.compile(r"<!-- example: columns=(\d+) -->")
UNIT = r"(?:ms|µs|us|s|min|/min|%|×|x|GB/s|TFLOP/s)"
MEASURED = re.compile(rf"\d+\.\d+|\d+(?=\s?{UNIT}(?![\w-]))|\d+:\d\d:\d\d")
# a config's values (NAME=VALUE): which config wins is a measurement too (timings decide it, even under the interpreter)
CHOSEN = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=\S+")
RULES = re.compile(r"[─━═│┃┏┓┗┛┡┩┳┻╇╈┣┫┠┨┯┷┼╋└┘┌┐├┤┬┴]+")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # of the command, 1-based
    columns: int
    command: str
    output: str


def examples(path: Path) -> list[Example]:
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines):
        m = MARKER.fullmatch(line.strip())
        if not m:
            continue
        assert lines[i + 1].startswith("```console"), f"{path.name}:{i + 1}: an example marker needs a console block"
        assert lines[i + 2].startswith("$ "), f"{path.name}:{i + 3}: an example starts with its `$ ` command"
        end = next(j for j in range(i + 3, len(lines)) if lines[j].startswith("```"))
        found.append(Example(path, i + 3, int(m.group(1)), lines[i + 2][2:], "\n".join(lines[i + 3 : end])))
    return found


def shape(text: str) -> list[str]:
    """The output without what a run measures and without its layout: the words, labels and counts."""
    return RULES.sub("|", MEASURED.sub("#", CHOSEN.sub(r"\1=#", text))).split()


def run_example(ex: Example, cwd: Path) -> str:
    words = shlex.split(ex.command)
    assert words[0] == "dtune", f"{ex.path.name}:{ex.line}: an example runs a dtune command"
    env = {**os.environ, "COLUMNS": str(ex.columns), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # an example that runs kernels says --interpret itself
    proc = subprocess.run([sys.executable, "-m", "dtune", *words[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, f"{ex.path.name}:{ex.line}: `{ex.command}` exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout.rstrip("\n")


ALL = [ex for path in DOCS for ex in examples(path)]


def test_the_readme_has_examples() -> None:
    assert any(ex.path.name == "README.md" for ex in ALL)


@pytest.mark.parametrize("ex", ALL, ids=[f"{ex.path.name}:{ex.line}" for ex in ALL])
def test_an_example_shows_what_a_fresh_run_prints(ex: Example, tmp_path: Path) -> None:
    fresh = run_example(ex, tmp_path)
    assert shape(fresh) == shape(ex.output), (
        f"{ex.path.name}:{ex.line}: the example is stale; `python tests/test_readme.py --write` rewrites it. "
        f"A fresh run prints:\n{fresh}"
    )


INLINE = re.compile(r"`((?:dtune |python benchmarks/|bash scripts/)[^`]*)`")


def commands(path: Path) -> list[tuple[int, list[str]]]:
    """The shell commands of a file's bash and console blocks and its inline code that starts with ``dtune``,
    ``python benchmarks/`` or ``bash scripts/`` (not a synopsis with ``[...]``, ``|`` or ``...``): (line, words
    without env settings and comments)."""
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    block = None
    pending = ""
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block is None:
            spans = [m.group(1) for m in INLINE.finditer(line)]
            out += [(n, shlex.split(x)) for x in spans if not any(c in x for c in ("[", "|", "...", "…", "<"))]
            continue
        if block not in ("bash", "console"):
            continue
        if block == "console" and not line.startswith("$ ") and not pending:
            continue
        text = pending + (line[2:] if line.startswith("$ ") and not pending else line)
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        words = shlex.split(text, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if words:
            out.append((n, words))
    return out


ALL_COMMANDS = [(path, n, words) for path in DOCS for n, words in commands(path)]


def dtune_words(words: list[str]) -> list[str] | None:
    if words[0] == "dtune":
        return words[1:]
    if words[0].endswith("python") and words[1:3] == ["-m", "dtune"]:
        return words[3:]
    return None


@pytest.mark.parametrize(
    "words", [w for _, _, w in ALL_COMMANDS if dtune_words(w) is not None],
    ids=[f"{p.name}:{n}" for p, n, w in ALL_COMMANDS if dtune_words(w) is not None],
)  # fmt: skip
def test_a_dtune_command_parses(words: list[str]) -> None:
    import typer.main
    from typer._click.exceptions import MissingParameter

    from dtune.cli.main import app

    cli = typer.main.get_command(app)
    args = dtune_words(words) or []
    ctx = cli.make_context("dtune", list(args))
    # the group keeps the subcommand's words apart (click's protected args)
    name, command, rest = cli.resolve_command(ctx, [*getattr(ctx, "_protected_args", []), *ctx.args])
    assert command is not None, f"no command {name!r}"
    # raises on an unknown option or a bad value; a fragment in prose (`dtune bench --graph`) may leave out a
    # required option
    with contextlib.suppress(MissingParameter):
        command.make_context(name or "", rest, parent=ctx)


def script_of(words: list[str]) -> str | None:
    for w in words[:2]:
        if re.fullmatch(r"(benchmarks|scripts)/[\w.]+\.(py|sh)", w):
            return w
    return None


@pytest.mark.parametrize(
    "words", [w for _, _, w in ALL_COMMANDS if script_of(w)],
    ids=[f"{p.name}:{n}" for p, n, w in ALL_COMMANDS if script_of(w)],
)  # fmt: skip
def test_a_script_command_names_a_script_and_its_options(words: list[str]) -> None:
    script = script_of(words) or ""
    assert (ROOT / script).is_file(), f"{script} does not exist"
    if not script.endswith(".py"):
        return
    helps = _help(script)
    for w in words:
        if w.startswith("--"):
            assert w.split("=")[0] in helps, f"{script} has no option {w}"


_HELP: dict[str, str] = {}


def _help(script: str) -> str:
    if script not in _HELP:
        proc = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        _HELP[script] = proc.stdout
    return _HELP[script]


def write() -> None:
    """Rewrite every example block with a fresh run's output."""
    for path in DOCS:
        found = examples(path)
        if not found:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for ex in reversed(found):
            with tempfile.TemporaryDirectory() as tmp:
                fresh = run_example(ex, Path(tmp))
            end = next(j for j in range(ex.line, len(lines)) if lines[j].startswith("```"))
            lines[ex.line : end] = [line.rstrip() for line in fresh.splitlines()]
            print(f"{path.name}:{ex.line}: {ex.command}")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(f"usage: python {Path(__file__).relative_to(ROOT)} --write   (rewrites the examples)")
    write()
