"""The library example in README.md runs as written."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_library_example_runs(tmp_path: Path, monkeypatch: object) -> None:
    text = README.read_text()
    match = re.search(r"<!-- example:store -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its store example"
    monkeypatch.chdir(tmp_path)  # type: ignore[attr-defined]
    namespace: dict[str, object] = {}
    exec(compile(match[1], "README.md", "exec"), namespace)
    result = asyncio.run(namespace["main"]())  # type: ignore[operator]
    assert result == ("local-storage", 4, 7)
