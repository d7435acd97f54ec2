"""Edge cases of the PC's migration and placement."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from kvstore.client import IndexClient, InstanceClient
from kvstore.controller.migrate import Migrator
from kvstore.controller.placer import Placer
from kvstore.controller.rules import SessionEntry
from kvstore.controller.state import MemoryControllerState
from kvstore.protocol.problems import StaleEpoch
from kvstore.protocol.records import LookupRequest

from ..conftest import free_port
from .conftest import Instances
from .test_directives import status
from .test_state import Clock, checkpoint


async def failed_with_session(pc: MemoryControllerState, clock: Clock, dead: str) -> str:
    await pc.put_status(status(dead, ttl_ms=1000))
    session = str(uuid.uuid4())
    await pc.put_checkpoint(checkpoint(session, 1, 4), dead)
    clock.now += 2
    return session


async def refused_session(
    instances: Instances, good_ttl_ms: int
) -> tuple[MemoryControllerState, str, str, str]:
    """A failed instance's session, and one live instance that refuses it:
    (the PC's state, the session, the failed and the live instance)."""
    clock = Clock()
    pc = MemoryControllerState(clock=clock)
    dead, good = instances.uri("dead"), instances.uri("good")
    await pc.put_status(status(good, ttl_ms=good_ttl_ms))
    session = await failed_with_session(pc, clock, dead)
    instances.refuse.add("good")
    return pc, session, dead, good


async def test_a_session_every_candidate_refused_is_tried_again(instances: Instances) -> None:
    # It was left with the last instance that refused, never moved again.
    pc, session, dead, good = await refused_session(instances, 60_000)
    retry = Clock()
    async with InstanceClient() as client:
        migrator = Migrator(pc, Placer(pc, None), client, {}, clock=retry, jitter=lambda: 1.0)
        assert await migrator.run_once() == 0
        assert (await pc.session(session)).owner == dead  # still to be moved
        instances.refuse.clear()
        assert await migrator.run_once() == 0  # not yet: it backs off for 1 s
        retry.now += 1.0
        assert await migrator.run_once() == 1
    entry = await pc.session(session)
    assert entry.owner == good and entry.epoch == 4  # 2 refused, 3 back to dead, 4 moved


async def test_retries_back_off_and_log_one_error_then_summaries(
    instances: Instances, caplog: pytest.LogCaptureFixture
) -> None:
    # A session no instance takes was tried every round (0.5 s), each time
    # with an ERROR line, for as long as session_idle_s: now 1, 2, 4 ... s
    # apart up to the cap, one error, then a summary a minute.
    pc, session, _, good = await refused_session(instances, 3_600_000)
    retry = Clock()
    caplog.set_level(logging.DEBUG, "kvstore.controller")
    async with InstanceClient() as client:
        migrator = Migrator(
            pc, Placer(pc, None), client, {}, clock=retry, jitter=lambda: 1.0, retry_cap_s=16.0
        )
        for _ in range(240):  # two minutes of rounds every 0.5 s
            assert await migrator.run_once() == 0
            retry.now += 0.5
        # Tries at 0, 1, 3, 7, 15, 31, 47, 63, ... 111 s: 1 + 4 + 6 capped.
        assert len(instances.refused) == 11
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and session in errors[0].getMessage()
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        summaries = [m for m in said if "wait for an instance" in m]
        assert len(summaries) == 1 and summaries[0].startswith("1 session(s)"), summaries
        instances.refuse.clear()
        retry.now += 16.0
        assert await migrator.run_once() == 1
    moved = [r.getMessage() for r in caplog.records if "moved from" in r.getMessage()]
    assert moved and moved[-1].endswith("after 11 failed tries")
    assert (await pc.session(session)).owner == good


async def test_jitter_spreads_the_retries(instances: Instances) -> None:
    # Between half and all of the backoff: sessions of one failed instance
    # (and several PCs) do not all try again in the same round.
    pc, _, _, _ = await refused_session(instances, 3_600_000)
    retry = Clock()
    async with InstanceClient() as client:
        migrator = Migrator(
            pc, Placer(pc, None), client, {}, clock=retry, jitter=lambda: 0.0, retry_base_s=4.0
        )
        await migrator.run_once()
        retry.now += 1.9
        await migrator.run_once()
        assert len(instances.refused) == 1  # half of 4 s is not over
        retry.now += 0.1
        await migrator.run_once()
        assert len(instances.refused) == 2


async def test_a_full_candidate_is_skipped_not_the_round(instances: Instances) -> None:
    # A candidate at its session quota raised out of the whole round.
    clock = Clock()
    pc = MemoryControllerState(clock=clock, max_sessions_per_owner=1)
    dead, full, free = instances.uri("dead"), instances.uri("full"), instances.uri("free")
    await pc.put_status(status(full, ttl_ms=60_000))  # cheapest (no queue)
    await pc.put_status(status(free, ttl_ms=60_000, queued=2))
    await pc.put_checkpoint(checkpoint(str(uuid.uuid4()), 1, 1), full)
    session = await failed_with_session(pc, clock, dead)
    async with InstanceClient() as client:
        assert await Migrator(pc, Placer(pc, None), client, {}).run_once() == 1
    assert (await pc.session(session)).owner == free


async def test_an_index_answering_garbage_means_placing_without_cache() -> None:
    # P4: a 200 whose body is not JSON was a 500 for place and stopped migrations.
    import uvicorn

    async def lookup(_: Any) -> Response:
        return Response("<html>a proxy's page</html>", media_type="text/html")

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/is/lookup", lookup, methods=["POST"])]),
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="off",
        )
    )
    import asyncio

    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        pc = MemoryControllerState()
        await pc.put_status(status("https://ii.test/kvsp/"))
        async with IndexClient(f"http://127.0.0.1:{port}/is/") as index:
            placement = await Placer(pc, index).place("a" * 32, "b" * 64, ["c" * 64], 16, 4)
            assert placement.index == "unavailable" and placement.candidates
            with pytest.raises(Exception) as info:
                await index.lookup(LookupRequest("a" * 32, "b" * 64, ("c" * 64,)))
            assert getattr(info.value, "status", None) == 502
    finally:
        server.should_exit = True
        await task


async def test_only_instances_that_may_write_the_scope_are_candidates() -> None:
    # SEC1: a session (prompt and output tokens) went to another tenant's instance.
    pc = MemoryControllerState()
    mine, theirs = "https://mine.test/kvsp/", "https://theirs.test/kvsp/"
    await pc.put_status(status(mine, queued=5))
    await pc.put_status(status(theirs))  # cheaper, other tenant
    allowed = {mine: {"a" * 32}, theirs: {"f" * 32}}
    placer = Placer(pc, None, eligible=lambda i, scope: scope in allowed[i])
    placement = await placer.place("a" * 32, "b" * 64, [], 16, 4)
    assert [c.instance for c in placement.candidates] == [mine]


async def test_resume_carries_the_checkpoint_the_move_found(instances: Instances) -> None:
    # CK3: the failed instance checkpointed (and was acknowledged) after the
    # round read the session: the resume must not carry the older checkpoint.
    clock = Clock()

    class Racy(MemoryControllerState):
        late: Any = None

        async def _sessions_of(self, owner: str) -> list[SessionEntry]:
            found = await MemoryControllerState._sessions_of(self, owner)
            if self.late is not None:
                late, self.late = self.late, None
                await self.put_checkpoint(late, owner)
            return found

    pc = Racy(clock=clock)
    dead, good = instances.uri("dead"), instances.uri("good")
    await pc.put_status(status(good, ttl_ms=60_000))
    session = await failed_with_session(pc, clock, dead)
    pc.late = checkpoint(session, 1, 20)
    async with InstanceClient() as client:
        assert await Migrator(pc, Placer(pc, None), client, {}).run_once() == 1
    [(_, sent)] = instances.resumed
    assert sent["checkpoint"]["output_offset"] == 20


async def test_an_ended_session_is_not_resumed_into_being() -> None:
    # A session ended between a round's read and its move came back empty.
    pc = MemoryControllerState()
    session = str(uuid.uuid4())
    with pytest.raises(StaleEpoch):
        await pc.assign(session, "https://ii.test/kvsp/", epoch=2)
    await pc.assign(session, "https://ii.test/kvsp/", epoch=1)  # a new session is fine


async def test_prefetch_to_an_instance_gone_since_it_was_chosen() -> None:
    # A StopIteration (500) when the chosen instance expired meanwhile.
    from kvstore.controller.app import create_app
    from kvstore.security import Policy
    from kvstore.settings import ControllerSettings

    class Vanishing(MemoryControllerState):
        calls = 0

        async def active(self) -> Any:
            self.calls += 1
            return [] if self.calls > 1 else await MemoryControllerState.active(self)

    ii = "https://ii.test/kvsp/"
    pc = Vanishing()
    await pc.put_status(status(ii))
    policy = Policy.from_json(
        {
            "principals": {
                "anonymous": {
                    "roles": ["instance"],
                    "instance": ii,
                    "read_scopes": ["*"],
                    "write_scopes": ["*"],
                }
            }
        }
    )

    class Index:
        async def lookup(self, query: LookupRequest) -> Any:
            from kvstore.protocol.records import LookupResponse, ReplicaShape, Residency, ShapeRuns

            shape = ReplicaShape("https://h.test/", 1 << 20, (Residency("host", 0, 31),), 32)
            return LookupResponse(1, (), shapes=ShapeRuns(((shape,),), ((0, 1),)))

    settings = ControllerSettings(
        "http://pc.test/pc/", allow_anonymous=True, prefetch=True, block_tokens={"b" * 64: 4}
    )
    async with InstanceClient() as client:
        app = create_app(settings, pc, policy, Index(), client)
        import httpx

        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://pc.test/pc/"
        ) as http:
            body = {"scope_id": "a" * 32, "compat_id": "b" * 64, "block_keys": ["c" * 64]}
            response = await http.post("place", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["prefetch"] == {"error": "the instance is no longer active"}
    assert dataclasses.is_dataclass(pc)


async def test_sessions_of_a_restarted_instance_are_resumed(instances: Instances) -> None:
    # S2, CK5: an instance that restarted within its TTL (a higher epoch)
    # lost its earlier process's sessions; those it took on since stay.
    clock = Clock()
    pc = MemoryControllerState(clock=clock)
    again, other = instances.uri("again"), instances.uri("other")
    await pc.put_status(dataclasses.replace(status(again, ttl_ms=60_000), epoch=10))
    await pc.put_status(status(other, ttl_ms=60_000, queued=3))
    lost, kept = str(uuid.uuid4()), str(uuid.uuid4())
    await pc.put_checkpoint(checkpoint(lost, 1, 4), again)
    await pc.put_status(dataclasses.replace(status(again, ttl_ms=60_000), epoch=11))  # restart
    await pc.put_checkpoint(checkpoint(kept, 1, 2), again)  # the new process's own
    async with InstanceClient() as client:
        migrator = Migrator(pc, Placer(pc, None), client, {})
        assert await migrator.run_once() == 1
        assert await migrator.run_once() == 0  # done once
    [(name, sent)] = instances.resumed
    assert sent["checkpoint"]["session"] == lost and sent["epoch"] == 2
    assert name == "again"  # the cheapest instance, now in its new process
    assert (await pc.session(kept)).epoch == 1
    assert await pc.restarted() == []


# --- from the review of resharding and starting instances ---------------------


async def test_a_member_slower_than_the_client_timeout_but_in_time_commits(
    instances: Instances,
) -> None:
    # RS4: only deadline_ms bounds a plan's acknowledgement, not the
    # instance client's own (short) timeout.
    from kvstore.controller.coordinator import ReshardCoordinator

    from .test_coordinator import maps

    pc = MemoryControllerState()
    v4, v5 = maps(instances)
    await pc.create_map(v4)
    instances.slow.add("ii3")  # answers after 2 s
    async with InstanceClient(timeout_s=0.5) as client:
        outcome = await ReshardCoordinator(pc, client).reshard(v5, deadline_ms=5000)
    assert outcome.committed


async def test_a_cancelled_reshard_aborts_at_every_member(instances: Instances) -> None:
    # RS6: members drop what they fetched for v+1 also when the PC gives up.
    import asyncio

    from kvstore.controller.coordinator import ReshardCoordinator

    from .test_coordinator import maps

    pc = MemoryControllerState()
    v4, v5 = maps(instances)
    await pc.create_map(v4)
    instances.slow.add("ii1")
    async with InstanceClient() as client:
        task = asyncio.create_task(ReshardCoordinator(pc, client).reshard(v5, deadline_ms=5000))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
    aborts = sorted(n for n, b in instances.reshards if b == {"map": "c3f8", "abort": 5})
    assert aborts == ["ii1", "ii2", "ii3"]
    entry = await pc.shard_map("c3f8")
    assert entry.current == v4 and entry.pending is None


async def test_a_session_nobody_takes_is_dropped_once_idle(instances: Instances) -> None:
    # Moving it back to its failed owner is no sign of life: it was retried
    # every round, forever.
    clock = Clock()
    pc = MemoryControllerState(clock=clock)
    dead, good = instances.uri("dead"), instances.uri("good")
    await pc.put_status(status(good, ttl_ms=600_000))
    await failed_with_session(pc, clock, dead)
    instances.refuse.add("good")
    async with InstanceClient() as client:
        migrator = Migrator(pc, Placer(pc, None), client, {}, session_idle_s=10)
        for _ in range(4):
            await migrator.run_once()
            clock.now += 5
    assert await pc.sessions_of(dead) == [] and migrator.counters.sessions_dropped == 1


async def test_the_starter_takes_the_first_line_and_lets_the_command_run() -> None:
    # PL3: a command that prints the URI and goes on (it may be the instance)
    # was waited for until its timeout; bad URIs and odd request_refs.
    import sys
    import time

    from kvstore.controller.starter import InstanceStarter

    stays = InstanceStarter(
        [
            sys.executable,
            "-c",
            "import time; print('http://127.0.0.1:1/new/', flush=True); time.sleep(30)",
        ],
        timeout_s=20,
    )
    started = time.monotonic()
    assert await stays.start("a" * 32, "b" * 64, "ref\x00with a nul") == "http://127.0.0.1:1/new/"
    assert time.monotonic() - started < 10
    for printed in ("http://h.test/new/?x=1", "moqt://relay.test/ns", "not a uri"):
        bad = InstanceStarter([sys.executable, "-c", f"print({printed!r})"])
        assert await bad.start("a" * 32, "b" * 64, None) is None
        await bad.close(kill=True)
    await stays.close(kill=True)
