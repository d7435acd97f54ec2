"""The policy file: docs/security.md describes all of it, its example loads
and grants what the text says, and every invalid member is named by its path."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvstore.protocol.problems import Forbidden, ScopeDenied
from kvstore.protocol.wire import role_id
from kvstore.security import GRANT_MEMBERS, ROLES, Policy, PolicyError

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
A = "5d1e9a0c7b3f4e2a8c6d0b1f9e7a3c52"
B = "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5"
OTHER = "0" * 32


def example() -> str:
    match = re.search(r"<!-- example:policy -->\n```json\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/security.md lost its example policy"
    return match[1]


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    path = tmp_path / "policy.json"
    path.write_text(example())
    return Policy.load(path)


def test_the_doc_describes_every_member_and_role() -> None:
    text = DOC.read_text().split("## The policy file", 1)[1].split("\n## ", 1)[0]
    for member in ("principals", *GRANT_MEMBERS):
        assert f"| `{member}` |" in text, member
    for role in ROLES:
        assert f"| `{role}` |" in text, role


def test_the_example_grants_what_the_doc_says(policy: Policy) -> None:
    def urn(name: str) -> str:
        return f"urn:kvstore:{name}"

    # h1 publishes only as its own base URI, any scope, and reads nothing.
    h1 = policy.require_role(urn("h1"), "holder")
    assert h1.holder == "https://h1.example:8443/kvsp/"
    assert role_id(h1.holder) == role_id("https://h1.example:8443/kvsp/")
    policy.require_write(urn("h1"), B)
    with pytest.raises(ScopeDenied):
        policy.require_read(urn("h1"), A)
    # ii1 reports as itself and may serve tenant A only; ii2 both.
    ii1 = policy.require_role(urn("ii1"), "instance")
    assert (ii1.instance, ii1.holder) == (
        "https://ii1.example:8443/ii/",
        "https://ii1.example:8443/kvsp/",
    )
    assert ii1.can_write(A) and not ii1.can_write(B)
    assert policy.grant(urn("ii2")).can_write(B) and "holder" in policy.grant(urn("ii2")).roles
    # Only the PC drives instances; its lookups see every scope.
    policy.require_role(urn("pc"), "pc")
    policy.require_read(urn("pc"), OTHER)
    for name in ("ii1", "ops", "frontend-a"):
        with pytest.raises(Forbidden):
            policy.require_role(urn(name), "pc")
    # Tenants see only their own scope; frontend-a may report bad replicas.
    policy.require_read(urn("frontend-a"), A)
    policy.require_write(urn("frontend-a"), A)
    policy.require_role(urn("frontend-a"), "reporter")
    with pytest.raises(ScopeDenied):
        policy.require_read(urn("frontend-a"), B)
    with pytest.raises(ScopeDenied):
        policy.require_write(urn("frontend-b"), A)
    assert policy.grant(urn("frontend-b")).roles == {"client"}
    # Operators: admin and metrics, no tenant's data; Prometheus: metrics only.
    policy.require_role(urn("ops"), "admin")
    policy.require_any_role(urn("prometheus"), ("metrics", "admin"))
    with pytest.raises(Forbidden):
        policy.require_role(urn("prometheus"), "admin")
    with pytest.raises(ScopeDenied):
        policy.require_read(urn("ops"), A)
    # Anyone else of the CA: nothing.
    with pytest.raises(Forbidden):
        policy.require_read(urn("mallory"), A)


BROKEN: list[tuple[Any, list[str]]] = [
    ([], ['policy: must be a JSON object {"principals": {...}}']),
    ({}, ["policy: principals: required member is missing"]),
    (
        {"principals": [], "version": 1},
        [
            "policy: version: unknown member; known: principals",
            "policy: principals: must be an object",
        ],
    ),
    (
        {"principals": {"urn:x": {"read_scopes": ["*", "ABC"]}}},
        ['policy: principals["urn:x"].read_scopes[1]: must be a hex16 scope id'],
    ),
    (
        {"principals": {"urn:x": {"roles": ["hodler", 7], "write_scopes": "*"}}},
        [
            "policy: principals[\"urn:x\"].roles[0]: unknown role 'hodler'; known: admin, client",
            'policy: principals["urn:x"].roles[1]: must be a string (role names)',
            'policy: principals["urn:x"].write_scopes: must be an array of scope ids or "*"',
        ],
    ),
    (
        {
            "principals": {
                "urn:h": {"roles": ["holder"], "holder": "h1:8443/kvsp/"},
                "urn:i": {"instance": 5, "read_scope": ["*"]},
                "": {},
                "urn:v6": {"holder": "https://[::1:8443/"},
            }
        },
        [
            'policy: principals["urn:h"].holder: must be an absolute https (or http) base URI',
            'policy: principals["urn:i"].read_scope: unknown member; known: roles, read_scopes',
            'policy: principals["urn:i"].instance: must be an absolute https (or http) base URI',
            'policy: principals[""]: a principal name must be a non-empty string',
            'policy: principals["urn:v6"].holder: must be an absolute https (or http) base URI',
        ],
    ),
    ({"principals": {"urn:x": "admin"}}, ['policy: principals["urn:x"]: must be an object']),
]


@pytest.mark.parametrize(("document", "messages"), BROKEN)
def test_every_invalid_member_is_named_by_its_path(document: Any, messages: list[str]) -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_json(document)
    assert len(info.value.problems) == len(messages), info.value.problems
    for problem, message in zip(info.value.problems, messages, strict=True):
        assert problem.startswith(message), (problem, message)
    # One line, every problem, the source said once.
    assert "\n" not in str(info.value) and str(info.value).count("policy: ") == 1


def test_load_names_the_file_and_repeated_names(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('{"principals": {"urn:x": {"roles": ["pc"], "roles": []}, "urn:x": {}}}')
    with pytest.raises(PolicyError) as info:
        Policy.load(path)
    assert info.value.problems == (f'{path}: principals["urn:x"]: given more than once',)
    path.write_text('{"principals": {"urn:x": {"roles": ["pc"], "roles": []}}}')
    with pytest.raises(PolicyError, match=r'principals\["urn:x"\]\.roles: given more than once'):
        Policy.load(path)
    path.write_text('{"principals": ')
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not JSON: "):
        Policy.load(path)
    with pytest.raises(OSError):
        Policy.load(tmp_path / "absent.json")


def test_valid_documents_keep_their_meaning() -> None:
    policy = Policy.from_json(
        {
            "principals": {
                "anonymous": {"read_scopes": ["*"]},
                "urn:h": {"roles": ["holder", "metrics"], "holder": None, "write_scopes": [A, A]},
                "urn:none": {"roles": []},
            }
        }
    )
    assert policy.grant("anonymous").roles == {"client"}
    assert policy.grant("anonymous").can_read(OTHER)
    assert policy.grant("urn:h").write_scopes == {A} and policy.grant("urn:h").holder is None
    assert policy.grant("urn:none").roles == frozenset()
