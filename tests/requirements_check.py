"""docs/conformance.md lists every requirement ID of the specification.

The requirements live beside the repository (``../shared/spec/REQUIREMENTS.md``
in the project's workspace), not in a clone, so this cross-check is a step of
``.ci/run`` of its own, after ``make test``:

    python -m tests.requirements_check ../shared/spec/REQUIREMENTS.md

The parsing is tested in ``tests/test_conformance_doc.py`` on inline texts,
so the suite checks the checker in any clone.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "docs" / "conformance.md"


def requirement_ids(requirements: str) -> list[str]:
    """The IDs of REQUIREMENTS.md: each line ``- ID **M** text``."""
    return re.findall(r"^- ([A-Z]+\d+) ", requirements, re.M)


def listed_ids(conformance: str) -> set[str]:
    """The IDs named in the first cell of conformance.md's table rows;
    ``C1, C2`` and ranges ``PL1-PL3`` / ``PL1-3`` both count."""
    listed: set[str] = set()
    for cell in re.findall(r"^\| ([A-Z0-9, -]+?) \|", conformance, re.M):
        for part in (p.strip() for p in cell.split(",")):
            match = re.fullmatch(r"([A-Z]+)(\d+)-(?:[A-Z]+)?(\d+)", part)
            if match:
                listed.update(f"{match[1]}{n}" for n in range(int(match[2]), int(match[3]) + 1))
            else:
                listed.add(part)
    return listed


def unlisted(requirements: str, conformance: str) -> list[str]:
    """Requirement IDs that conformance.md does not list, in spec order."""
    listed = listed_ids(conformance)
    return [i for i in requirement_ids(requirements) if i not in listed]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.requirements_check REQUIREMENTS.md", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        requirements = path.read_text()
    except OSError as exc:
        print(f"requirements_check: {exc}", file=sys.stderr)
        return 2
    ids = requirement_ids(requirements)
    if len(ids) < 80:  # a truncated or reformatted file must not pass as "all listed"
        print(f"requirements_check: {path} lists only {len(ids)} IDs", file=sys.stderr)
        return 1
    missing = unlisted(requirements, CONFORMANCE.read_text())
    if missing:
        print(f"docs/conformance.md does not list: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(f"docs/conformance.md lists all {len(ids)} requirement IDs of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
