"""docs/conformance.md names real tests: every test name it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.update(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
    return names


def test_every_cited_test_exists() -> None:
    doc = (ROOT / "docs" / "conformance.md").read_text()
    # File names (test_x.py) are not test names; "test_x_*" cites a family.
    cited = set(re.findall(r"\b(test_\w+)\b(?![.*])", doc))
    prefixes = set(re.findall(r"\b(test_\w+)\*", doc))
    tests = defined_tests()
    missing = sorted(c for c in cited - prefixes if c not in tests)
    assert not missing, f"docs/conformance.md cites tests that do not exist: {missing}"
    for prefix in prefixes:
        assert any(t.startswith(prefix) for t in tests), prefix


def test_every_requirement_id_is_listed() -> None:
    reqs = (ROOT.parent / "shared" / "spec" / "REQUIREMENTS.md").read_text()
    doc = (ROOT / "docs" / "conformance.md").read_text()
    ids = re.findall(r"^- ([A-Z]+\d+) ", reqs, re.M)
    assert len(ids) > 80
    listed: set[str] = set()
    for cell in re.findall(r"^\| ([A-Z0-9, -]+?) \|", doc, re.M):
        for part in cell.split(","):
            part = part.strip()
            match = re.fullmatch(r"([A-Z]+)(\d+)-(?:[A-Z]+)?(\d+)", part)
            if match:
                listed.update(f"{match[1]}{n}" for n in range(int(match[2]), int(match[3]) + 1))
            else:
                listed.add(part)
    assert not [i for i in ids if i not in listed]
