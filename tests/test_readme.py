"""Every ```python block of README.md runs as pasted into a file; fragments
that are not meant to run are in other fences (```text, ```sh)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[tuple[str, str]]:
    """(name, code) of each python block; the name is its <!-- example:NAME -->."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"(?:<!-- example:(\w+) -->\n)?```python\n(.*?)```", text, re.S):
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((match[1] or f"line {line}", match[2]))
    return blocks


def test_every_python_block_is_named_and_checked() -> None:
    # A new block must say what it prints, below, or not be a python block.
    assert sorted(name for name, _ in python_blocks()) == sorted(EXPECTED)


EXPECTED = {
    # The store example returns where layers 4-7 ended up.
    "store": "('local-storage', 4, 7)",
    "protocol": "3 block keys, layers 4-7",
}


@pytest.mark.parametrize(("name", "code"), python_blocks())
def test_python_block_runs_as_a_file(name: str, code: str, tmp_path: Path) -> None:
    # As a user would: the block alone in a file, run from an empty directory.
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"README.md {name}:\n{done.stderr}"
    assert EXPECTED.get(name, "\0") in done.stdout, done.stdout
