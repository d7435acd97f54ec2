"""Resharding from map version v to v+1 through the PC (RS2-RS7), against
stand-in instances over real HTTP."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.client import InstanceClient
from kvstore.controller.app import create_app
from kvstore.controller.coordinator import ReshardCoordinator
from kvstore.controller.redis_state import RedisControllerState
from kvstore.controller.reshard import plan_reshard
from kvstore.controller.state import ControllerState, MemoryControllerState
from kvstore.protocol.control import Shard, ShardMap
from kvstore.protocol.problems import PlanConflict
from kvstore.security import Policy
from kvstore.settings import ControllerSettings

from ..holder.conftest import AsPrincipal
from .conftest import Instances


def maps(inst: Instances) -> tuple[ShardMap, ShardMap]:
    """The draft's example: v4 over three instances, v5 over two."""
    ii1, ii2, ii3 = (inst.uri(n) for n in ("ii1", "ii2", "ii3"))
    v4 = ShardMap(
        "c3f8", 4, (Shard(0, 32768, ii1), Shard(32768, 65536, ii2), Shard(65536, 98304, ii3))
    )
    v5 = ShardMap("c3f8", 5, (Shard(0, 49152, ii1), Shard(49152, 98304, ii3)))
    return v4, v5


@pytest.fixture(params=["memory", "redis"])
async def pc(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        yield MemoryControllerState()
        return
    server: Any = request.getfixturevalue("redis_server")
    state = RedisControllerState(server.url, f"t{uuid.uuid4().hex[:8]}:")
    yield state
    await state.close()


async def test_all_acknowledge_then_commit(instances: Instances, pc: ControllerState) -> None:
    # RS3: retained ranges are not transferred; RS4/RS5: after every member
    # acknowledged, v+1 is current and every member gets the commit.
    v4, v5 = maps(instances)
    await pc.create_map(v4)
    async with InstanceClient() as client:
        outcome = await ReshardCoordinator(pc, client).reshard(v5, deadline_ms=1000)
    assert outcome.committed and outcome.version == 5 and not outcome.missing
    plans = {instances.uri(n): b for n, b in instances.reshards if "to" in b}
    assert plans == {m: p.to_json() for m, p in plan_reshard(v4, v5, 1000).items()}
    commits = sorted(n for n, b in instances.reshards if b == {"map": "c3f8", "commit": 5})
    assert commits == ["ii1", "ii2", "ii3"]
    assert (await pc.shard_map("c3f8")).current == v5
    assert (await pc.shard_map("c3f8")).pending is None


async def test_a_missing_acknowledgement_aborts(instances: Instances, pc: ControllerState) -> None:
    # RS6: a member that does not answer by deadline_ms: abort to all, v stays.
    v4, v5 = maps(instances)
    await pc.create_map(v4)
    instances.slow.add("ii3")
    async with InstanceClient() as client:
        outcome = await ReshardCoordinator(pc, client).reshard(v5, deadline_ms=300)
    assert not outcome.committed and outcome.version == 4
    assert list(outcome.missing) == [instances.uri("ii3")]
    aborts = sorted(n for n, b in instances.reshards if b == {"map": "c3f8", "abort": 5})
    assert aborts == ["ii1", "ii2", "ii3"]
    entry = await pc.shard_map("c3f8")
    assert entry.current == v4 and entry.pending is None
    # A refusal aborts as well, and the map can be resharded again after.
    instances.slow.clear()
    instances.refuse.add("ii2")
    async with InstanceClient() as client:
        assert not (await ReshardCoordinator(pc, client).reshard(v5, 1000)).committed
        instances.refuse.clear()
        assert (await ReshardCoordinator(pc, client).reshard(v5, 1000)).committed


async def test_one_reshard_at_a_time_and_only_to_v_plus_1(
    instances: Instances, pc: ControllerState
) -> None:
    # RS5, RS7: v stays authoritative while a reshard runs; a target that is
    # not the next version of the current map is a plan conflict.
    v4, v5 = maps(instances)
    await pc.create_map(v4)
    instances.slow.add("ii1")
    async with InstanceClient() as client:
        coordinator = ReshardCoordinator(pc, client)
        first = asyncio.create_task(coordinator.reshard(v5, deadline_ms=3000))
        await asyncio.sleep(0.3)
        with pytest.raises(PlanConflict):
            await coordinator.reshard(v5, deadline_ms=1000)
        assert (await first).committed
        with pytest.raises(PlanConflict) as info:
            await coordinator.reshard(v5, deadline_ms=1000)  # 5 -> 5
        assert info.value.status == 409 and info.value.suffix == "kvsp-plan-conflict"
    with pytest.raises(PlanConflict):
        await pc.create_map(v4)  # another map under the same id


async def test_reshard_resources(instances: Instances, certs: Path) -> None:
    # Ours: PUT/GET maps/{map} and POST maps/{map}/reshard, for admins only.
    pc = MemoryControllerState()
    v4, v5 = maps(instances)
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

        def as_(name: str) -> httpx.AsyncClient:
            wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
            return httpx.AsyncClient(
                transport=httpx.ASGITransport(wrapped), base_url="https://pc.test/pc/"
            )

        async with as_("alice") as alice, as_("ii1") as other:
            assert (await other.put("maps/c3f8", json=v4.to_json())).status_code == 403
            assert (await alice.put("maps/other", json=v4.to_json())).status_code == 400
            assert (await alice.put("maps/c3f8", json=v4.to_json())).status_code == 200
            got = (await alice.get("maps/c3f8")).json()
            assert got["version"] == 4 and got["resharding_to"] is None
            body = {"target": v5.to_json(), "deadline_ms": 1000}
            assert (await other.post("maps/c3f8/reshard", json=body)).status_code == 403
            instances.refuse.add("ii2")
            refused = await alice.post("maps/c3f8/reshard", json=body)
            assert refused.status_code == 502
            assert list(refused.json()["missing"]) == [instances.uri("ii2")]
            instances.refuse.clear()
            done = await alice.post("maps/c3f8/reshard", json=body)
            assert done.status_code == 200 and done.json()["version"] == 5
            again = await alice.post("maps/c3f8/reshard", json=body)
            assert again.status_code == 409
            # Maps are the PC's own resources, not what kvsp-not-found covers.
            for missing in (
                await alice.get("maps/none"),
                await alice.post(
                    "maps/none/reshard", json={**body, "target": {**v5.to_json(), "map": "none"}}
                ),
            ):
                assert missing.status_code == 404 and missing.json()["type"] == "about:blank"
