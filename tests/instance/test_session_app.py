"""The instance's session resources over ASGI with client certificates:
``POST generate`` streams NDJSON tokens with index and epoch (CK4), ``GET
sessions/{id}/tokens?from=N`` streams again from N, ``GET sessions/{id}``;
resume, reshard and contexts only from the PC (SEC1); a principal of another
scope sees no session (L3)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.backends.host import HostTier
from kvstore.instance.app import create_app
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.instance.reference import ReferenceEngine
from kvstore.instance.reporter import Load
from kvstore.instance.sessions import Sessions
from kvstore.instance.shards import Shards
from kvstore.protocol.control import ResumeRequest, Sampler, SessionCheckpoint
from kvstore.security import Policy, create_dev_certificates
from kvstore.settings import InstanceSettings
from kvstore.storage import TieredStore

from ..holder.conftest import AsPrincipal
from .test_sessions import PROMPT, SCOPE, SCOPE_KEY, uninterrupted

OTHER = "f" * 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ReferenceEngine:
    return ReferenceEngine(tmp_path_factory.mktemp("ref"), block_tokens=8)


@pytest.fixture
async def clients(
    engine: ReferenceEngine, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, httpx.AsyncClient], Sessions]]:
    create_dev_certificates(tmp_path, ["pc", "tenant", "stranger"])
    policy = Policy.from_json(
        {
            "principals": {
                "urn:kvstore:pc": {"roles": ["pc", "metrics"]},
                "urn:kvstore:tenant": {"read_scopes": [SCOPE]},
                "urn:kvstore:stranger": {"read_scopes": [OTHER]},
            }
        }
    )
    store = TieredStore([(HostTier(), 64 << 20)])
    prefetcher = Prefetcher(store, None)
    lifecycle = Lifecycle()
    sessions = Sessions(
        InstanceSettings("https://ii.test/ii/"),
        engine,
        store,
        {SCOPE: SCOPE_KEY},
        lifecycle,
        Load(),
        prefetcher=prefetcher,
    )
    shards = Shards(store, prefetcher, policy, 8)
    app = create_app(
        InstanceSettings("https://ii.test/ii/"), prefetcher, policy, lifecycle, sessions, shards
    )
    found = {}
    for name in ("pc", "tenant", "stranger"):
        wrapped = AsPrincipal(app, (tmp_path / f"client-{name}.pem").read_text())
        found[name] = httpx.AsyncClient(
            transport=httpx.ASGITransport(wrapped), base_url="https://ii.test/ii/"
        )
    yield found, sessions
    for client in found.values():
        await client.aclose()
    await sessions.close()


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]


async def test_generate_streams_tokens_and_a_session_can_be_read_again(
    clients: tuple[dict[str, httpx.AsyncClient], Sessions], engine: ReferenceEngine
) -> None:
    http, _ = clients
    session = str(uuid.uuid4())
    body = {"session": session, "scope_id": SCOPE, "tokens": PROMPT, "max_tokens": 9}
    response = await http["tenant"].post("generate", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    assert response.headers["cache-control"] == "no-store"
    events = lines(response)
    assert events[0] == {"event": "session", "session": session, "epoch": 1, "resumed_from": None}
    got = [e for e in events if "index" in e]
    assert [e["index"] for e in got] == list(range(9)) and {e["epoch"] for e in got} == {1}
    assert [e["token"] for e in got] == uninterrupted(
        engine, PROMPT, 9, Sampler("greedy", 0, 0, True)
    )
    assert events[-1]["event"] == "done" and events[-1]["output_tokens"] == 9
    again = lines(await http["tenant"].get(f"sessions/{session}/tokens", params={"from": 6}))
    assert [e["index"] for e in again if "index" in e] == [6, 7, 8]
    state = (await http["tenant"].get(f"sessions/{session}")).json()
    assert state["state"] == "done" and state["released"] == 9
    # Another scope's principal: "absent" and "not yours" read the same (L3).
    for path in (f"sessions/{session}", f"sessions/{session}/tokens"):
        assert (await http["stranger"].get(path)).status_code == 404
        assert (
            await http["tenant"].get(path.replace(session, str(uuid.uuid4())))
        ).status_code == 404
    refused = await http["stranger"].post("generate", json={**body, "session": str(uuid.uuid4())})
    assert refused.status_code == 403
    bad = await http["tenant"].get(f"sessions/{session}/tokens", params={"from": "x"})
    assert bad.status_code == 400
    assert (await http["tenant"].post("generate", json={**body, "tokens": []})).status_code == 400
    assert (await http["tenant"].post("generate", json=body)).status_code == 409  # exists
    # OPS1: fetched (loaded) versus recomputed tokens, output tokens.
    scraped = (await http["pc"].get("https://ii.test/metrics")).text
    assert "kvstore_instance_output_tokens_total 9.0" in scraped
    assert f"kvstore_instance_computed_tokens_total {float(len(PROMPT))}" in scraped
    assert (await http["tenant"].get("https://ii.test/metrics")).status_code == 403


async def test_resume_reshard_and_contexts_only_from_the_pc(
    clients: tuple[dict[str, httpx.AsyncClient], Sessions],
) -> None:
    http, sessions = clients
    checkpoint = SessionCheckpoint(
        str(uuid.uuid4()),
        1,
        sessions.compat_id,
        SCOPE,
        (),
        tuple(PROMPT),
        (),
        0,
        Sampler("greedy", 0, 0, True),
    )
    body = ResumeRequest(2, checkpoint).to_json()
    path = f"sessions/{checkpoint.session}/resume"
    assert (await http["tenant"].post(path, json=body)).status_code == 403
    resumed = await http["pc"].post(path, json=body)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["epoch"] == 2 and resumed.json()["computed_tokens"] == len(PROMPT)
    again = await http["pc"].post(path, json=body)  # the same epoch again: stale (CK7)
    assert again.status_code == 409 and "stale-epoch" in again.json()["type"]
    wrong = await http["pc"].post(f"sessions/{uuid.uuid4()}/resume", json=body)
    assert wrong.status_code == 400
    context = {
        "scope_id": SCOPE,
        "compat_id": sessions.compat_id,
        "block_keys": [],
        "version": 1,
        "ranges": [],
    }
    assert (await http["tenant"].put("contexts/m", json=context)).status_code == 403
    assert (await http["pc"].put("contexts/m", json=context)).status_code == 200
    plan = {"map": "m", "from": 2, "to": 3, "deadline_ms": 100}
    assert (await http["tenant"].post("reshard", json=plan)).status_code == 403
    conflict = await http["pc"].post("reshard", json=plan)
    assert conflict.status_code == 409 and "plan-conflict" in conflict.json()["type"]
    # RS7, H3: no version of the map here does not match the plan (maps are
    # not what kvsp-not-found covers); its context is a plain 404.
    unknown = await http["pc"].post("reshard", json={**plan, "map": "n"})
    assert unknown.status_code == 409 and "plan-conflict" in unknown.json()["type"]
    for message in ({"map": "n", "commit": 3}, {"map": "n", "abort": 3}):
        assert (await http["pc"].post("reshard", json=message)).status_code == 409
    missing = await http["pc"].get("contexts/n")
    assert missing.status_code == 404 and missing.json()["type"] == "about:blank"
    ok = await http["pc"].post("reshard", json={**plan, "from": 1, "to": 2})
    assert ok.status_code == 200 and ok.json()["resharding_to"] == 2
    committed = await http["pc"].post("reshard", json={"map": "m", "commit": 2})
    assert committed.json()["version"] == 2 and committed.json()["resharding_to"] is None
    unaligned = await http["pc"].post("reshard", json={**plan, "retain": [[0, 5]]})
    assert unaligned.status_code == 400
