"""The PC's directives to instances, against a stand-in instance server over
real HTTP: prefetch after a placement (PL2, PF1, PF2), resume of the
sessions of a failed instance (CK5, CK7, SEC5), the end of a session."""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.client import InstanceClient
from kvstore.controller.app import create_app
from kvstore.controller.migrate import Migrator
from kvstore.controller.placer import Placement, Placer, directive
from kvstore.controller.redis_state import RedisControllerState
from kvstore.controller.state import ControllerState, MemoryControllerState
from kvstore.http import role_of
from kvstore.protocol.control import InstanceStatus, Link, ResumeRequest
from kvstore.protocol.keys import PackedKeys
from kvstore.protocol.problems import Forbidden, StaleEpoch
from kvstore.protocol.records import (
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    ReplicaShape,
    Residency,
    ShapeRuns,
)
from kvstore.protocol.wire import role_id
from kvstore.security import Policy
from kvstore.settings import ControllerSettings

from ..conftest import free_port
from ..holder.conftest import AsPrincipal
from .conftest import Instances
from .test_state import Clock, checkpoint

COMPAT, SCOPE = "b" * 64, "a" * 32
H1, H2 = "https://h1.test/kvsp/", "https://h2.test/kvsp/"
KEYS = [f"{n:064x}" for n in range(6)]


def status(instance: str, *links: Link, ttl_ms: int = 3000, queued: int = 0) -> InstanceStatus:
    return InstanceStatus(
        instance=instance,
        epoch=1,
        state="active",
        running=0,
        queued=queued,
        batch_size=8,
        kv_utilization=0.1,
        prefill_tokens_per_s=40000,
        decode_tokens_per_s=3000,
        ttl_ms=ttl_ms,
        links=links,
    )


def shape(holder: str) -> ReplicaShape:
    return ReplicaShape(holder, 1 << 20, (Residency("host", 0, 31),), 32)


class FakeIndex:
    """An IS answering every lookup with the given runs of shapes."""

    def __init__(self, runs: list[tuple[tuple[ReplicaShape, ...], int]]) -> None:
        groups = list(dict.fromkeys(g for g, _ in runs))
        self.shapes = ShapeRuns(tuple(groups), tuple((groups.index(g), n) for g, n in runs))
        self.queries: list[LookupRequest] = []

    async def lookup(self, query: LookupRequest) -> LookupResponse:
        self.queries.append(query)
        matched = min(self.shapes.matched, len(query.block_keys))
        assert matched == self.shapes.matched, "tests look up enough keys"
        return LookupResponse(matched, (), shapes=self.shapes)


# --- prefetch directives ------------------------------------------------------


def test_directive_lists_what_the_instance_lacks_cheapest_source_first() -> None:
    # PF2: blocks in order, whole replicas' holders cheapest first; blocks
    # already at the instance, and replicas missing layers, left out.
    ii = "https://ii.test/kvsp/"
    partial = ReplicaShape(H1, 1 << 20, (Residency("host", 0, 15),), 32)
    runs = [((shape(H1), shape(H2)), 2), ((shape(ii), shape(H1)), 1), ((partial, shape(H2)), 1)]
    placement = Placement([], 4, "ok", runs)  # type: ignore[arg-type]
    near_h2 = status(ii, Link(H1, 100000.0, 50.0), Link(H2, 100000.0, 10.0))
    found = directive(
        placement,
        ii,
        near_h2.links,
        KEYS,
        SCOPE,
        COMPAT,
        deadline_ms=50,
        lease_ms=2000,
        request_ref="r-1",
    )
    assert found is not None
    assert [(b.block_key, b.sources) for b in found.blocks] == [
        (KEYS[0], (H2, H1)),
        (KEYS[1], (H2, H1)),
        (KEYS[3], (H2,)),
    ]
    assert PrefetchDirective.from_json(found.to_json()) == found
    assert (found.deadline_ms, found.lease_ms, found.request_ref) == (50, 2000, "r-1")
    # Keys that came packed (POST place as octets) give the same directive.
    packed = PackedKeys(b"".join(bytes.fromhex(k) for k in KEYS))
    again = directive(
        placement,
        ii,
        near_h2.links,
        packed,
        SCOPE,
        COMPAT,
        deadline_ms=50,
        lease_ms=2000,
        request_ref="r-1",
    )
    assert again is not None and again.blocks == found.blocks
    only_resident = Placement([], 1, "ok", [((shape(ii),), 1)])
    links = near_h2.links
    assert (
        directive(only_resident, ii, links, KEYS, SCOPE, COMPAT, deadline_ms=1, lease_ms=1) is None
    )


async def place(app: Any, certs: Path, body: dict[str, Any]) -> httpx.Response:
    wrapped = AsPrincipal(app, (certs / "client-alice.pem").read_text())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(wrapped), base_url="https://pc.test/pc/"
    ) as client:
        return await client.post("place", json=body)


async def test_place_sends_the_chosen_instance_a_prefetch_directive(
    instances: Instances, certs: Path
) -> None:
    # PL2, PF1: the cheapest active instance gets the directive at once; the
    # answer says where its status lives.
    pc = MemoryControllerState()
    near, far = instances.uri("near"), instances.uri("far")
    await pc.put_status(status(near, Link(H1, 100000.0, 10.0)))
    await pc.put_status(status(far, Link(H1, 1000.0, 10.0)))
    gone = f"http://127.0.0.1:{free_port()}/gone/"  # nothing listens there
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:alice": {"read_scopes": ["*"]},
                **{
                    f"urn:kvstore:{n}": {
                        "roles": ["instance"],
                        "instance": uri,
                        "write_scopes": [SCOPE],
                    }
                    for n, uri in (("near", near), ("far", far), ("gone", gone))
                },
            }
        }
    )
    settings = ControllerSettings(
        "https://pc.test/pc/",
        block_tokens={COMPAT: 4},
        prefetch=True,
        prefetch_deadline_ms=80,
        prefetch_lease_ms=3000,
    )
    index = FakeIndex([((shape(H1),), 3)])
    async with InstanceClient() as client:
        app = create_app(settings, pc, policy, index, client)
        body = {
            "scope_id": SCOPE,
            "compat_id": COMPAT,
            "block_keys": KEYS[:4],
            "tokens": 16,
            "request_ref": "front-7",
        }
        response = await place(app, certs, body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["instance"] == near and answer["matched"] == 3
        [(name, sent)] = instances.prefetched
        assert name == "near" and sent["request_ref"] == "front-7"
        assert [b["block_key"] for b in sent["blocks"]] == KEYS[:3]
        assert (sent["deadline_ms"], sent["lease_ms"], sent["scope_id"]) == (80, 3000, SCOPE)
        assert answer["prefetch"]["location"] == f"{near}prefetch/{sent['directive']}"
        assert index.queries[0].shapes_only
        # A directive the instance does not take leaves the placement standing.
        await pc.put_status(status(gone, Link(H1, 1e6, 1.0)))
        response = await place(app, certs, body)
        assert response.status_code == 200
        assert response.json()["instance"] == gone and "error" in response.json()["prefetch"]
        assert (
            role_of(app).counters.prefetches == 1 and role_of(app).counters.prefetch_failures == 1
        )
        response = await place(app, certs, {**body, "request_ref": "x" * 300})
        assert response.status_code == 400


# --- resume after a failure ---------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def state(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ControllerState, Clock]]:
    clock = Clock()
    if request.param == "memory":
        yield MemoryControllerState(clock=clock), clock
        return
    server: Any = request.getfixturevalue("redis_server")
    found = RedisControllerState(server.url, f"t{uuid.uuid4().hex[:8]}:", clock=clock)
    yield found, clock
    await found.close()


async def test_sessions_of_a_failed_instance_resume_elsewhere(
    instances: Instances, state: tuple[ControllerState, Clock]
) -> None:
    # CK5: a new instance by placement, the epoch raised, the latest
    # checkpoint sent; CK7, SEC5: the failed instance is fenced off.
    pc, clock = state
    dead, busy, good = instances.uri("dead"), instances.uri("busy"), instances.uri("good")
    await pc.put_status(status(dead, ttl_ms=1000))
    await pc.put_status(status(busy, Link(H1, 1e5, 5.0), ttl_ms=60_000))  # cheapest, but refuses
    await pc.put_status(status(good, ttl_ms=60_000, queued=1))
    instances.refuse.add("busy")
    sessions = [str(uuid.uuid4()) for _ in range(3)]
    await pc.put_checkpoint(
        dataclasses.replace(
            checkpoint(sessions[0], 1, 5), compat_id=COMPAT, prompt_blocks=tuple(KEYS[:3])
        ),
        dead,
    )
    await pc.assign(sessions[1], dead)  # no checkpoint: cannot be resumed
    await pc.put_checkpoint(checkpoint(sessions[2], 1, 2), good)  # on a live instance
    async with InstanceClient() as client:
        migrator = Migrator(
            pc, Placer(pc, FakeIndex([((shape(H1),), 3)]), 1000.0), client, {COMPAT: 4}
        )
        assert await migrator.run_once() == 0  # nobody failed yet
        clock.now += 2
        assert await migrator.run_once() == 1
    # busy got epoch 2 and refused; good took it at epoch 3.
    [(name, sent)] = instances.resumed
    request = ResumeRequest.from_json(sent)
    assert name == "good" and request.epoch == 3
    assert request.checkpoint.session == sessions[0] and request.checkpoint.output_offset == 5
    entry = await pc.session(sessions[0])
    assert (entry.owner, entry.epoch) == (good, 3)
    late = dataclasses.replace(checkpoint(sessions[0], 1, 9), compat_id=COMPAT)
    with pytest.raises(StaleEpoch):  # CK7: the old epoch's messages are rejected
        await pc.put_checkpoint(late, dead)
    with pytest.raises(Forbidden):
        await pc.put_checkpoint(dataclasses.replace(late, epoch=3), dead)
    assert await pc.sessions_of(dead) == []  # the one without a checkpoint is forgotten
    assert (await pc.session(sessions[2])).owner == good
    assert (migrator.counters.migrations, migrator.counters.sessions_dropped) == (1, 1)


async def test_two_pcs_move_a_session_once(instances: Instances, redis_server: Any) -> None:
    # PCs sharing Redis race for a failed instance's session: the epoch's
    # compare-and-set lets one of them resume it.
    clock = Clock()
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    pcs = [RedisControllerState(redis_server.url, prefix, clock=clock) for _ in range(2)]
    dead, good = instances.uri("dead"), instances.uri("good")
    await pcs[0].put_status(status(dead, ttl_ms=1000))
    await pcs[0].put_status(status(good, ttl_ms=60_000))
    session = str(uuid.uuid4())
    await pcs[0].put_checkpoint(checkpoint(session, 1, 4), dead)
    clock.now += 2
    async with InstanceClient() as client:
        migrators = [Migrator(pc, Placer(pc, None), client, {}) for pc in pcs]
        moved = await asyncio.gather(*(m.run_once() for m in migrators))
    assert sum(moved) == 1 and len(instances.resumed) == 1
    assert (await pcs[1].session(session)).epoch == 2
    for pc in pcs:
        await pc.close()


async def test_an_ended_session_is_not_migrated(
    instances: Instances, state: tuple[ControllerState, Clock]
) -> None:
    pc, clock = state
    dead, good = instances.uri("dead"), instances.uri("good")
    await pc.put_status(status(dead, ttl_ms=1000))
    await pc.put_status(status(good, ttl_ms=60_000))
    done, idle = str(uuid.uuid4()), str(uuid.uuid4())
    await pc.put_checkpoint(checkpoint(done, 1, 4), dead)
    with pytest.raises(Forbidden):
        await pc.end_session(done, good)  # only the owner ends it
    await pc.end_session(done, dead)
    await pc.put_checkpoint(checkpoint(idle, 1, 4), dead)
    clock.now += 700  # idle beyond session_idle_s (600 s)
    async with InstanceClient() as client:
        migrator = Migrator(pc, Placer(pc, None), client, {})
        assert await migrator.run_once() == 0
    assert instances.resumed == [] and migrator.counters.sessions_dropped == 1
    assert await pc.sessions_of(dead) == []


async def test_delete_session_resource(certs: Path) -> None:
    # Ours: DELETE sessions/{session} by the owner only.
    pc = MemoryControllerState()
    ii1 = "https://ii1.test/kvsp/"
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:ii1": {"roles": ["instance"], "instance": ii1, "write_scopes": ["*"]},
                "urn:kvstore:alice": {"read_scopes": ["*"]},
            }
        }
    )
    app = create_app(ControllerSettings("https://pc.test/pc/"), pc, policy)
    session = str(uuid.uuid4())
    await pc.put_checkpoint(checkpoint(session, 1, 1), ii1)
    for name, expected in (("alice", 403), ("ii1", 204), ("ii1", 404)):
        wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(wrapped), base_url="https://pc.test/pc/"
        ) as client:
            response = await client.delete(f"sessions/{session}")
        assert response.status_code == expected, (name, response.text)
    assert role_id(ii1)  # the instance's id is what its status path names


async def test_an_operator_wakes_a_sleeping_instance(instances: Instances, certs: Path) -> None:
    # S3, S6: only the PC wakes a sleeping instance: it sends PUT state, then
    # holds the instance active; a refused change leaves the state as it was.
    pc = MemoryControllerState()
    sleepy = instances.uri("sleepy")
    await pc.put_status(status(sleepy))
    await pc.set_state(sleepy, "sleeping")
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:alice": {"roles": ["admin"]},
                "urn:kvstore:ii1": {"read_scopes": ["*"]},
            }
        }
    )
    async with InstanceClient() as client:
        app = create_app(ControllerSettings("https://pc.test/pc/"), pc, policy, None, client)

        async def put(name: str, instance: str, body: Any) -> httpx.Response:
            wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(wrapped), base_url="https://pc.test/pc/"
            ) as http:
                return await http.put(f"instances/{role_id(instance)}/state", json=body)

        assert (await put("ii1", sleepy, {"state": "active"})).status_code == 403
        assert (await put("alice", sleepy, {"state": "failed"})).status_code == 400
        unknown = await put("alice", "https://nobody.test/", {"state": "active"})
        assert unknown.status_code == 404
        assert await pc.state_of(sleepy) == "sleeping" and instances.states == []
        response = await put("alice", sleepy, {"state": "active"})
        assert response.status_code == 200 and response.json() == {"state": "active"}
        assert instances.states == [("sleepy", {"state": "active"})]
        assert await pc.state_of(sleepy) == "active"
        gone = f"http://127.0.0.1:{free_port()}/gone/"
        await pc.put_status(status(gone))
        await pc.set_state(gone, "sleeping")
        refused = await put("alice", gone, {"state": "active"})
        assert refused.status_code == 502
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert await pc.state_of(gone) == "sleeping"


async def test_an_instance_is_started_when_none_fits(instances: Instances, certs: Path) -> None:
    # PL3: no active instance (or none cheap enough): the operator's command
    # starts one, the request goes there and its directive is sent at once;
    # one start per cooldown, and a failed start means 409 as before.
    import sys

    pc = MemoryControllerState()
    new = instances.uri("new")
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:alice": {"read_scopes": ["*"]},
                "urn:kvstore:new": {
                    "roles": ["instance"],
                    "instance": new,
                    "write_scopes": [SCOPE],
                },
            }
        }
    )
    runs = certs.parent / f"runs-{uuid.uuid4().hex[:6]}"
    command = (
        sys.executable,
        "-c",
        f"import os; assert os.environ['KVSP_SCOPE_ID'] == '{SCOPE}'; "
        f"open({str(runs)!r}, 'a').write('x'); print('{new}', flush=True)",
    )
    settings = ControllerSettings(
        "https://pc.test/pc/",
        block_tokens={COMPAT: 4},
        prefetch=True,
        start_command=shlex.join(command),
        start_cooldown_s=60,
    )
    body = {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": KEYS[:2], "tokens": 8}
    async with InstanceClient() as client:
        app = create_app(settings, pc, policy, FakeIndex([((shape(H1),), 2)]), client)
        response = await place(app, certs, body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["instance"] == new and answer["started"] is True
        [(name, sent)] = instances.prefetched
        assert name == "new" and [b["block_key"] for b in sent["blocks"]] == KEYS[:2]
        # A burst, and placements within the cooldown, go to the same new
        # instance: it is started once.
        answers = await asyncio.gather(*(place(app, certs, body) for _ in range(4)))
        assert {a.json()["instance"] for a in answers} == {new}
        assert role_of(app).counters.instances_started == 1 and runs.read_text() == "x"
        await app.state.starter.close(kill=True)
    # An active instance that fits is used: nothing is started.
    old = instances.uri("old")
    await pc.put_status(status(old, Link(H1, 1e5, 10.0)))
    with_old = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:alice": {"read_scopes": ["*"]},
                "urn:kvstore:old": {"roles": ["instance"], "instance": old, "write_scopes": ["*"]},
            }
        }
    )
    async with InstanceClient() as client:
        app = create_app(settings, pc, with_old, FakeIndex([((shape(H1),), 2)]), client)
        answer = (await place(app, certs, body)).json()
        assert answer["instance"] == old and "started" not in answer
        assert role_of(app).counters.instances_started == 0
    failing = dataclasses.replace(
        settings, start_command=shlex.join((sys.executable, "-c", "exit(3)"))
    )
    async with InstanceClient() as client:
        app = create_app(failing, MemoryControllerState(), policy, FakeIndex([]), client)
        assert (await place(app, certs, {**body, "block_keys": []})).status_code == 409
        await app.state.starter.close(kill=True)
