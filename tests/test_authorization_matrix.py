"""The authorization matrix (issue 9, SEC1, L3, PF5): every role's resources
against every kind of principal, in-process with real certificates at the
ASGI TLS extension (TLS itself, no certificate and another CA's, is in
tests/integration/test_holder_tls.py).

Each cell is the status a principal gets. Where a principal may not learn
whether something exists, the answer for a resource that exists and for one
that does not must be the same, status and problem type alike."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.backends.host import HostTier
from kvstore.controller.app import create_app as create_controller
from kvstore.controller.state import MemoryControllerState
from kvstore.holder import HolderSettings
from kvstore.holder import create_app as create_holder
from kvstore.index import IndexSettings, MemoryState
from kvstore.index import create_app as create_index
from kvstore.instance.app import create_app as create_instance
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.protocol.control import InstanceStatus, Sampler, SessionCheckpoint
from kvstore.protocol.wire import role_id
from kvstore.security import Policy, create_dev_certificates
from kvstore.settings import ControllerSettings, InstanceSettings
from kvstore.storage import LeaseLimits, TieredStore

from .holder.conftest import AsPrincipal
from .storage.helpers import block

A, B = "a" * 32, "b" * 32
COMPAT = "c" * 64
H1, H2 = "https://h1.test/kvsp/", "https://h2.test/kvsp/"
II1 = "https://ii1.test/ii/"
PRINCIPALS = ("holder1", "holder2", "pc", "ii1", "alice", "bob", "stranger", None)
POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:holder1": {"roles": ["holder"], "holder": H1, "write_scopes": [A]},
            "urn:kvstore:holder2": {"roles": ["holder"], "holder": H2, "write_scopes": [A, B]},
            "urn:kvstore:pc": {"roles": ["pc"], "read_scopes": ["*"]},
            "urn:kvstore:ii1": {"roles": ["instance"], "instance": II1, "write_scopes": [A]},
            "urn:kvstore:alice": {"read_scopes": [A], "write_scopes": [A]},
            "urn:kvstore:bob": {"read_scopes": [B], "write_scopes": [B]},
            # "stranger" has a certificate of our CA but no entry in the policy.
        }
    }
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("matrix-certs")
    create_dev_certificates(directory, [p for p in PRINCIPALS if p is not None])
    return directory


class Roles:
    def __init__(self, certs: Path) -> None:
        self.certs = certs
        self.store = TieredStore([(HostTier(), 16 << 20)], lease_limits=LeaseLimits())
        self.pc_state = MemoryControllerState()
        self.apps = {
            "holder": (H1, create_holder(HolderSettings(H1), self.store, POLICY)),
            "index": (
                "https://is.test/is/",
                create_index(IndexSettings("https://is.test/is/"), MemoryState(), POLICY),
            ),
            "pc": (
                "https://pc.test/pc/",
                create_controller(
                    ControllerSettings("https://pc.test/pc/", block_tokens={COMPAT: 4}),
                    self.pc_state,
                    POLICY,
                ),
            ),
            "instance": (
                II1,
                create_instance(
                    InstanceSettings(II1), Prefetcher(self.store, None), POLICY, Lifecycle()
                ),
            ),
        }
        self.clients: list[httpx.AsyncClient] = []

    def as_(self, role: str, who: str | None) -> httpx.AsyncClient:
        base, app = self.apps[role]
        cert = (self.certs / f"client-{who}.pem").read_text() if who else None
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(AsPrincipal(app, cert)), base_url=base
        )
        self.clients.append(client)
        return client

    async def status(
        self, role: str, who: str | None, method: str, path: str, **kw: Any
    ) -> tuple[int, str | None]:
        response = await self.as_(role, who).request(method, path, **kw)
        kind = None
        problem = response.headers.get("content-type", "").startswith("application/problem+json")
        if problem and method != "HEAD":
            kind = response.json().get("type", "").rsplit("#", 1)[-1]
        return response.status_code, kind


@pytest.fixture
async def roles(certs: Path) -> AsyncIterator[Roles]:
    found = Roles(certs)
    yield found
    for client in found.clients:
        await client.aclose()


def key(n: int) -> str:
    return f"{n:064x}"


def block_path(scope: str, n: int) -> str:
    return f"blocks/{COMPAT}/{scope}/{key(n)}"


def record(holder: str, n: int, scope: str = A) -> dict[str, Any]:
    return {
        "block_key": key(n),
        "compat_id": COMPAT,
        "scope_id": scope,
        "holder": holder,
        "codec": 1,
        "size": 100,
        "digest": "sha-256:" + "0" * 64,
        "residency": [{"tier": "host", "layers": [0, 7]}],
        "ttl_ms": 60000,
    }


async def test_holder_resources(roles: Roles) -> None:
    headers = {"If-None-Match": "*", "Content-Type": "application/kvsp-block"}
    assert (
        await roles.status(
            "holder", "alice", "PUT", block_path(A, 1), content=block(), headers=headers
        )
    )[0] == 201
    expected = {
        "alice": 200,
        "pc": 200,
        "bob": 403,
        "holder1": 403,
        "holder2": 403,
        "ii1": 403,
        "stranger": 403,
        None: 401,
    }
    for who, code in expected.items():
        held = await roles.status("holder", who, "GET", block_path(A, 1))
        absent = await roles.status("holder", who, "GET", block_path(A, 2))
        assert held[0] == code, (who, held)
        if code != 200:
            assert held == absent, who  # not yours == absent (no existence oracle)
    for who, code in {"alice": 201, "bob": 403, "pc": 403, "stranger": 403, None: 401}.items():
        got = await roles.status(
            "holder",
            who,
            "PUT",
            block_path(A, 10 + len(str(who))),
            content=block(),
            headers=headers,
        )
        assert got[0] == code, (who, got)
    # Leases only over blocks of scopes the client may read: bob's lease of
    # A's key pins nothing, and answers as for a key nobody holds.
    from kvstore.storage import BlockRef

    held_ref = BlockRef(COMPAT, A, key(1))
    lease = {"block_keys": [key(1)], "ttl_ms": 1000}
    bob_held = await roles.status("holder", "bob", "POST", "leases", json=lease)
    bob_absent = await roles.status(
        "holder", "bob", "POST", "leases", json={**lease, "block_keys": [key(2)]}
    )
    assert not roles.store.leases.is_leased(held_ref)
    assert bob_held == bob_absent, (bob_held, bob_absent)
    granted = await roles.as_("holder", "alice").post("leases", json=lease)
    assert granted.status_code == 201 and roles.store.leases.is_leased(held_ref)
    # Another client cannot renew or release it: the answer of an unknown lease.
    lease_path = f"leases/{granted.json()['lease']}"
    for method, body in (("PUT", {"json": {"ttl_ms": 1000}}), ("DELETE", {})):
        for who in ("bob", "pc", "holder1"):
            theirs = await roles.status("holder", who, method, lease_path, **body)
            unknown = await roles.status("holder", who, method, "leases/unknown", **body)
            assert theirs == unknown and theirs[0] in (403, 404), (method, who, theirs)
        assert (await roles.status("holder", None, method, lease_path, **body))[0] == 401
    assert roles.store.leases.is_leased(held_ref)
    # HEAD answers as GET does, body aside.
    for who, code in expected.items():
        held = await roles.status("holder", who, "HEAD", block_path(A, 1))
        assert held[0] == code, (who, held)
        if code != 200:
            assert held[0] == (await roles.status("holder", who, "HEAD", block_path(A, 2)))[0]
    # Store-wide metrics: a side channel, for the metrics or admin role only.
    for who in ("alice", "bob", "pc", "holder1", "stranger"):
        assert (await roles.status("holder", who, "GET", "https://h1.test/metrics"))[0] == 403
    assert (await roles.status("holder", None, "GET", "https://h1.test/metrics"))[0] == 401


async def test_index_resources(roles: Roles) -> None:
    put = f"replicas/{role_id(H1)}/{key(1)}"
    expected = {
        "holder1": (200, 204),
        "holder2": (403,),
        "pc": (403,),
        "ii1": (403,),
        "alice": (403,),
        "bob": (403,),
        "stranger": (403,),
        None: (401,),
    }
    for who, codes in expected.items():
        got = await roles.status("index", who, "PUT", put, json=record(H1, 1))
        assert got[0] in codes, (who, got)
    # A holder trusted for A only cannot publish B's (SEC2); its own only.
    assert (
        await roles.status(
            "index", "holder1", "PUT", f"replicas/{role_id(H1)}/{key(3)}", json=record(H1, 3, B)
        )
    )[0] == 403
    lookup = {"scope_id": A, "compat_id": COMPAT, "block_keys": [key(1)]}
    absent = {**lookup, "block_keys": [key(9)]}
    for who in ("alice", "pc"):
        got = await roles.as_("index", who).post("lookup", json=lookup)
        assert got.status_code == 200 and got.json()["matched"] == 1, who
    # Others get the answer of a prefix nobody holds (L3: no replicas of a
    # scope they may not read, and no sign that any exist).
    for who in ("bob", "holder2", "ii1", "stranger"):
        held = await roles.as_("index", who).post("lookup", json=lookup)
        missing = await roles.as_("index", who).post("lookup", json=absent)
        assert held.status_code == missing.status_code, who
        if held.status_code == 200:
            assert held.json() == missing.json() and held.json()["matched"] == 0, who
        else:
            assert held.status_code == 403 and held.json() == missing.json(), who
    assert (await roles.status("index", None, "POST", "lookup", json=lookup))[0] == 401
    # Withdrawal: the holder itself only.
    for who in ("holder2", "alice", "pc"):
        assert (await roles.status("index", who, "DELETE", put))[0] == 403, who
    assert (await roles.status("index", "holder1", "DELETE", put))[0] in (200, 204)


def _status(instance: str) -> dict[str, Any]:
    return InstanceStatus(instance, 1, "active", 0, 0, 8, 0.0, 1000.0, 100.0, 3000).to_json()


def _checkpoint(session: str, scope: str = A) -> dict[str, Any]:
    return SessionCheckpoint(
        session, 1, COMPAT, scope, (), (1, 2), (), 0, Sampler("greedy", 0, 0, False)
    ).to_json()


async def test_controller_resources(roles: Roles) -> None:
    path = f"instances/{role_id(II1)}/status"
    for who, code in {
        "ii1": 200,
        "holder1": 403,
        "pc": 403,
        "alice": 403,
        "stranger": 403,
        None: 401,
    }.items():
        assert (await roles.status("pc", who, "PUT", path, json=_status(II1)))[0] == code, who
    session = str(uuid.uuid4())
    checkpoint = f"sessions/{session}/checkpoint"
    for who, code in {"alice": 403, "pc": 403, "holder1": 403, None: 401}.items():
        got = await roles.status("pc", who, "PUT", checkpoint, json=_checkpoint(session))
        assert got[0] == code, (who, got)
    # An instance only in scopes it may write.
    other = str(uuid.uuid4())
    assert (
        await roles.status(
            "pc", "ii1", "PUT", f"sessions/{other}/checkpoint", json=_checkpoint(other, B)
        )
    )[0] == 403
    assert (await roles.status("pc", "ii1", "PUT", checkpoint, json=_checkpoint(session)))[0] == 200
    # Where a session is: readers of its scope; others cannot tell it exists.
    assert (await roles.status("pc", "alice", "GET", f"sessions/{session}"))[0] == 200
    for who in ("bob", "ii1", "holder1", "stranger"):
        held = await roles.status("pc", who, "GET", f"sessions/{session}")
        absent = await roles.status("pc", who, "GET", f"sessions/{uuid.uuid4()}")
        assert held == absent and held[0] in (403, 404), (who, held, absent)
    # Ending it: the owner only.
    for who in ("alice", "pc"):
        assert (await roles.status("pc", who, "DELETE", f"sessions/{session}"))[0] == 403, who
    # Placement: readers of the scope.
    place = {"scope_id": A, "compat_id": COMPAT, "block_keys": [key(1)]}
    assert (await roles.status("pc", "alice", "POST", "place", json=place))[0] == 200
    for who, code in {"bob": 403, "ii1": 403, "stranger": 403, None: 401}.items():
        assert (await roles.status("pc", who, "POST", "place", json=place))[0] == code, who
    # Operators' resources: admin (or metrics for the listing) only.
    shard_map = {"map": "m", "version": 1, "shards": [{"tokens": [0, 4], "instance": II1}]}
    operators = (
        ("GET", "instances", None),
        ("PUT", "maps/m", shard_map),
        ("GET", "maps/m", None),
        ("POST", "maps/m/reshard", {"target": {**shard_map, "version": 2}}),
        ("PUT", f"instances/{role_id(II1)}/state", {"state": "draining"}),
    )
    for method, path, body in operators:
        for who in ("alice", "pc", "ii1", "holder1", "stranger"):
            got = await roles.status("pc", who, method, path, json=body)
            assert got[0] == 403, (method, path, who, got)
        assert (await roles.status("pc", None, method, path, json=body))[0] == 401, path


async def test_instance_resources(roles: Roles) -> None:
    directive = {
        "directive": str(uuid.uuid4()),
        "scope_id": A,
        "compat_id": COMPAT,
        "blocks": [],
        "deadline_ms": 10,
        "lease_ms": 10,
    }
    for who, code in {
        "pc": 202,
        "alice": 403,
        "ii1": 403,
        "holder1": 403,
        "stranger": 403,
        None: 401,
    }.items():
        got = await roles.status(
            "instance", who, "POST", "prefetch", json={**directive, "directive": str(uuid.uuid4())}
        )
        assert got[0] == code, (who, got)
    for path, body in (
        ("state", {"state": "active"}),
        ("reshard", {"map": "m", "commit": 2}),
        (f"sessions/{uuid.uuid4()}/resume", {"epoch": 2}),
    ):
        for who in ("alice", "ii1", "holder1", "stranger"):
            got = await roles.status(
                "instance", who, "POST" if path != "state" else "PUT", path, json=body
            )
            assert got[0] == 403, (path, who, got)
        got = await roles.status(
            "instance", None, "POST" if path != "state" else "PUT", path, json=body
        )
        assert got[0] == 401, (path, got)
    assert (await roles.status("instance", "pc", "PUT", "state", json={"state": "active"}))[
        0
    ] == 200


async def test_instance_session_resources(certs: Path, tmp_path: Path) -> None:
    # Generation and the session resources of an instance with an engine:
    # readers of the session's scope only; others (and no identity) get the
    # answer of a session that does not exist. Prefetch status and contexts:
    # the PC only.
    from kvstore.instance.reference import ReferenceEngine
    from kvstore.instance.reporter import Load
    from kvstore.instance.sessions import Sessions
    from kvstore.instance.shards import Shards
    from kvstore.settings import InstanceSettings

    from .instance.test_sessions import PROMPT, SCOPE, SCOPE_KEY

    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:holder1": {"roles": ["holder"], "holder": H1, "write_scopes": [SCOPE]},
                "urn:kvstore:pc": {"roles": ["pc"]},
                "urn:kvstore:ii1": {
                    "roles": ["instance"],
                    "instance": II1,
                    "write_scopes": [SCOPE],
                },
                "urn:kvstore:alice": {"read_scopes": [SCOPE]},
                "urn:kvstore:bob": {"read_scopes": [B]},
            }
        }
    )
    store = TieredStore([(HostTier(), 64 << 20)])
    prefetcher, lifecycle = Prefetcher(store, None), Lifecycle()
    sessions = Sessions(
        InstanceSettings(II1),
        ReferenceEngine(tmp_path, block_tokens=8),
        store,
        {SCOPE: SCOPE_KEY},
        lifecycle,
        Load(),
        prefetcher=prefetcher,
    )
    app = create_instance(
        InstanceSettings(II1),
        prefetcher,
        policy,
        lifecycle,
        sessions,
        Shards(store, prefetcher, policy, 8),
    )
    clients: list[httpx.AsyncClient] = []

    async def status(who: str | None, method: str, path: str, **kw: Any) -> tuple[int, str]:
        cert = (certs / f"client-{who}.pem").read_text() if who else None
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(AsPrincipal(app, cert)), base_url=II1
        )
        clients.append(client)
        response = await client.request(method, path, **kw)
        if response.status_code < 400:
            return response.status_code, ""
        problem = response.json()
        return response.status_code, f"{problem['type']} {problem.get('detail')}"

    try:
        session = str(uuid.uuid4())
        body = {"session": session, "scope_id": SCOPE, "tokens": PROMPT, "max_tokens": 3}
        for who, code in {
            "bob": 403,
            "holder1": 403,
            "pc": 403,
            "stranger": 403,
            None: 401,
        }.items():
            got = await status(who, "POST", "generate", json={**body, "session": str(uuid.uuid4())})
            assert got[0] == code, (who, got)
        assert (await status("alice", "POST", "generate", json=body))[0] == 200
        absent = str(uuid.uuid4())
        for path in (f"sessions/{session}", f"sessions/{session}/tokens?from=0"):
            assert (await status("alice", "GET", path))[0] == 200, path
            for who in ("bob", "holder1", "ii1", "pc", "stranger", None):
                held = await status(who, "GET", path)
                missing = await status(who, "GET", path.replace(session, absent))
                assert held == missing and held[0] in (401, 403, 404), (path, who, held)
        pc_only = (
            ("GET", f"prefetch/{uuid.uuid4()}", {}),
            ("GET", "contexts/m", {}),
            ("PUT", "contexts/m", {"json": {"block_keys": []}}),
        )
        for method, path, extra in pc_only:
            for who in ("alice", "bob", "holder1", "ii1", "stranger"):
                assert (await status(who, method, path, **extra))[0] == 403, (path, who)
            assert (await status(None, method, path, **extra))[0] == 401, path
            assert (await status("pc", method, path, **extra))[0] not in (401, 403), path
    finally:
        for client in clients:
            await client.aclose()
        await sessions.close()
