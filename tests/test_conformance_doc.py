"""docs/conformance.md names real tests: every test name it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

from .requirements_check import listed_ids, main, requirement_ids, unlisted

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


REQUIREMENTS = """\
## Leases (LE)
- LE1 `POST leases` grants.
- LE2 **M** No eviction of leased replicas.
- LE3 **M** Quotas.
## Placement (PL)
- PL1 **S** Cost.
- PL2 **S** Lowest cost.
- PL3 **O/S** Start one.
"""


def test_the_requirements_cross_check_reads_rows_and_ranges() -> None:
    # The cross-check against ../shared runs in .ci/run (requirements_check);
    # here its parser is checked on a text of the same form.
    assert requirement_ids(REQUIREMENTS) == ["LE1", "LE2", "LE3", "PL1", "PL2", "PL3"]
    doc = "| ID | status |\n|---|---|\n| LE1-LE3 | done |\n| PL1, PL2 | done |\n"
    assert unlisted(REQUIREMENTS, doc) == ["PL3"]
    assert unlisted(REQUIREMENTS, doc + "| PL3 | part |\n") == []
    assert listed_ids("| PL1-3 | done |\n") == {"PL1", "PL2", "PL3"}


def test_the_cross_check_fails_on_a_short_or_missing_file(tmp_path: Path) -> None:
    assert main([str(tmp_path / "absent.md")]) == 2
    (tmp_path / "short.md").write_text(REQUIREMENTS)
    assert main([str(tmp_path / "short.md")]) == 1


def test_conformance_md_names_only_well_formed_ids() -> None:
    # Every ID the matrix names is a well-formed ID (a typo such as "PL 1"
    # or "Pl1" would hide a requirement from the cross-check).
    doc = (ROOT / "docs" / "conformance.md").read_text()
    ids = listed_ids(doc) - {"ID"}  # the header cell of each table
    assert len(ids) > 80
    assert all(re.fullmatch(r"[A-Z]+\d+", i) for i in ids), sorted(ids)
