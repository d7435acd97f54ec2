"""The PC's resources in-process: status reports and checkpoints, with identities."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from kvstore.controller.app import create_app
from kvstore.controller.state import ControllerState, MemoryControllerState, SleepPolicy
from kvstore.protocol.wire import role_id
from kvstore.security import Policy, create_dev_certificates
from kvstore.settings import ControllerSettings

from ..holder.conftest import AsPrincipal
from .test_state import checkpoint, status

PC = "https://pc.test/pc/"
II1, II2 = "https://ii1.test/kvsp/", "https://ii2.test/kvsp/"

POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:ii1": {"roles": ["instance"], "instance": II1, "write_scopes": ["*"]},
            "urn:kvstore:ii2": {"roles": ["instance"], "instance": II2, "write_scopes": ["*"]},
            "urn:kvstore:alice": {"read_scopes": ["*"]},
            "urn:kvstore:ii3": {"roles": ["instance"], "instance": "https://ii3.test/kvsp/"},
        }
    }
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pc-certs")
    create_dev_certificates(directory, ["ii1", "ii2", "ii3", "alice"])
    return directory


@pytest.fixture
def pc() -> ControllerState:
    return MemoryControllerState(sleep_policy=SleepPolicy(idle_for_s=0))


@pytest.fixture
async def as_(
    certs: Path, pc: ControllerState
) -> AsyncIterator[Callable[[str], httpx.AsyncClient]]:
    app = create_app(ControllerSettings(PC, block_tokens={"b" * 64: 4}), pc, POLICY)
    clients: list[httpx.AsyncClient] = []

    def make(name: str) -> httpx.AsyncClient:
        wrapped = AsPrincipal(app, (certs / f"client-{name}.pem").read_text())
        client = httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=PC)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


def status_path(instance: str) -> str:
    return f"instances/{role_id(instance)}/status"


async def test_status_report_and_sleeping_answer(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # S1-S3: reports are recorded; a sleep request is answered with the state.
    ii1 = as_("ii1")
    ok = await ii1.put(status_path(II1), json=status(II1).to_json())
    assert ok.status_code == 200 and ok.json() == {"state": "active"}
    assert ok.headers["content-type"] == "application/kvsp+json"
    idle = status(II1, running=0, queued=0, requested_state="sleeping")
    assert (await ii1.put(status_path(II1), json=idle.to_json())).json() == {"state": "draining"}


async def test_stale_epoch_is_409(as_: Callable[[str], httpx.AsyncClient]) -> None:
    ii1 = as_("ii1")
    await ii1.put(status_path(II1), json=status(II1, epoch=5).to_json())
    stale = await ii1.put(status_path(II1), json=status(II1, epoch=4).to_json())
    assert stale.status_code == 409
    assert stale.json()["type"].endswith("#kvsp-stale-epoch")


async def test_instances_report_only_for_themselves(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    # SEC1
    ii1, alice = as_("ii1"), as_("alice")
    assert (await ii1.put(status_path(II2), json=status(II2).to_json())).status_code == 403
    assert (await ii1.put(status_path(II1), json=status(II2).to_json())).status_code == 400
    assert (await alice.put(status_path(II1), json=status(II1).to_json())).status_code == 403
    bad = await ii1.put(status_path(II1), json={"instance": II1})
    assert bad.status_code == 400


async def test_checkpoints_and_fencing(
    as_: Callable[[str], httpx.AsyncClient], pc: ControllerState
) -> None:
    # CK2, CK7: the owner checkpoints; after a move the old owner is refused.
    ii1, ii2 = as_("ii1"), as_("ii2")
    session = str(uuid.uuid4())
    path = f"sessions/{session}/checkpoint"
    ack = await ii1.put(path, json=checkpoint(session, 1, 8).to_json())
    assert ack.status_code == 200 and ack.json() == {"epoch": 1, "output_offset": 8}
    await pc.assign(session, II2, epoch=2)
    old = await ii1.put(path, json=checkpoint(session, 1, 16).to_json())
    assert old.status_code == 409 and old.json()["type"].endswith("#kvsp-stale-epoch")
    assert (await ii1.put(path, json=checkpoint(session, 2, 16).to_json())).status_code == 403
    assert (await ii2.put(path, json=checkpoint(session, 2, 10).to_json())).json() == {
        "epoch": 2,
        "output_offset": 10,
    }
    other = await ii2.put(
        f"sessions/{uuid.uuid4()}/checkpoint", json=checkpoint(session, 2, 10).to_json()
    )
    assert other.status_code == 400
    # An epoch the PC never assigned is newer than current, not stale: a
    # 409 whose type does not say "older than current" (H3).
    fresh = str(uuid.uuid4())
    for body in (checkpoint(fresh, 2, 1), checkpoint(session, 3, 12)):
        ahead = await ii2.put(f"sessions/{body.session}/checkpoint", json=body.to_json())
        problem = ahead.json()
        assert ahead.status_code == 409 and problem["type"] == "about:blank", problem
        assert problem["title"] == "Conflict" and "never assigned" in problem["detail"]


async def test_place_errors(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # POST place: the caller must read the scope; the compat must be known;
    # with no active instance there is no choice (S4).
    alice, ii1 = as_("alice"), as_("ii1")
    body = {"scope_id": "a" * 32, "compat_id": "c" * 64, "block_keys": [], "tokens": 8}
    assert (await alice.post("place", json=body)).status_code == 400  # compat unknown
    assert (await ii1.post("place", json=body)).status_code == 403  # no read scope


async def test_place_without_index_ranks_active_instances(
    as_: Callable[[str], httpx.AsyncClient],
) -> None:
    alice, ii1 = as_("alice"), as_("ii1")
    body = {"scope_id": "a" * 32, "compat_id": "b" * 64, "block_keys": [], "tokens": 8}
    nobody = await alice.post("place", json=body)
    assert nobody.status_code == 409 and nobody.json()["type"].endswith("#kvsp-invalid-state")
    await ii1.put(status_path(II1), json=status(II1).to_json())
    choice = await alice.post("place", json=body)
    assert choice.status_code == 200
    assert choice.json()["instance"] == II1
    assert choice.json()["candidates"][0]["recompute_us"] == 1e6 * 8 / 40000


async def test_checkpoint_needs_the_scope(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # SEC1: ii3 may not write any scope; its checkpoint is refused, not stored.
    session = str(uuid.uuid4())
    response = await as_("ii3").put(
        f"sessions/{session}/checkpoint", json=checkpoint(session, 1, 1).to_json()
    )
    assert response.status_code == 403


async def test_place_never_answers_infinity(as_: Callable[[str], httpx.AsyncClient]) -> None:
    # An instance reporting a prefill rate of 0 has no finite estimate: null.
    await as_("ii1").put(status_path(II1), json=status(II1, prefill_tokens_per_s=0).to_json())
    body = {"scope_id": "a" * 32, "compat_id": "b" * 64, "block_keys": [], "tokens": 8}
    response = await as_("alice").post("place", json=body)
    assert response.status_code == 200 and b"Infinity" not in response.content
    assert response.json()["candidates"][0]["recompute_us"] is None


async def test_place_without_a_reachable_index(certs: Path, pc: ControllerState) -> None:
    # P4: the index is advisory; an unreachable IS means recompute, not an error.
    from kvstore.client import IndexClient

    from ..conftest import free_port

    async with IndexClient(f"http://127.0.0.1:{free_port()}/is/", timeout_s=2) as index:
        app = create_app(ControllerSettings(PC, block_tokens={"b" * 64: 4}), pc, POLICY, index)
        wrapped = AsPrincipal(app, (certs / "client-alice.pem").read_text())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(wrapped), base_url=PC) as c:
            await pc.put_status(status(II1))
            body = {
                "scope_id": "a" * 32,
                "compat_id": "b" * 64,
                "block_keys": ["c" * 64],
                "tokens": 8,
            }
            response = await c.post("place", json=body)
    assert response.status_code == 200
    assert response.json()["index"] == "unavailable" and response.json()["matched"] == 0
    assert response.json()["instance"] == II1


async def test_front_ends_find_a_session_and_its_end(
    as_: Callable[[str], httpx.AsyncClient], pc: ControllerState
) -> None:
    # Ours (CK4's front end): where a session is now, also after it ended
    # (its last owner has the end); only for readers of its scope (L3).
    alice, ii1, ii2 = as_("alice"), as_("ii1"), as_("ii2")
    session = str(uuid.uuid4())
    assert (await alice.get(f"sessions/{session}")).status_code == 404
    await ii1.put(f"sessions/{session}/checkpoint", json=checkpoint(session, 1, 4).to_json())
    found = (await alice.get(f"sessions/{session}")).json()
    assert (found["instance"], found["epoch"], found["ended"]) == (II1, 1, False)
    await pc.assign(session, II2, epoch=2)
    await ii2.put(f"sessions/{session}/checkpoint", json=checkpoint(session, 2, 6).to_json())
    assert (await ii2.delete(f"sessions/{session}")).status_code == 204
    ended = (await alice.get(f"sessions/{session}")).json()
    assert (ended["instance"], ended["epoch"], ended["ended"]) == (II2, 2, True)
    assert ended["output_offset"] == 6
    # ii1 may write the scope but not read it: "absent" and "not yours" match.
    assert (await ii1.get(f"sessions/{session}")).status_code == 404
