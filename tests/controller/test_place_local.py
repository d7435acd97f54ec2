"""Placement without the wire (issue 20): with the PC and an IS in one
process the placer asks the IS's state in process (LocalIndex), and the
answer is the one the IS gives over HTTP; ``POST place`` also takes the
block keys compactly, as base64 of their 32 octets each."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvstore.build import index_in_process
from kvstore.config import Config
from kvstore.controller.app import create_app
from kvstore.controller.state import MemoryControllerState
from kvstore.http import role_of
from kvstore.index import MemoryState
from kvstore.index import create_app as create_index
from kvstore.index.local import LocalIndex
from kvstore.protocol.control import Link
from kvstore.protocol.records import LookupRequest, LookupResponse, ReplicaRecord, Residency
from kvstore.security import Policy
from kvstore.settings import ControllerSettings, IndexSettings

from ..holder.conftest import AsPrincipal
from .test_directives import COMPAT, H1, H2, SCOPE, status

KEYS = [hashlib.sha256(b"%d" % n).hexdigest() for n in range(40)]
II1, II2 = "https://ii1.test/kvsp/", "https://ii2.test/kvsp/"


def record(key: str, holder: str, first_host: int = 0) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(f"{key}{i}".encode()).hexdigest() for i in range(32))
    digest = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    return ReplicaRecord(
        block_key=key,
        compat_id=COMPAT,
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=1 << 20,
        digest="sha-256:" + digest,
        layer_digests=digests,
        residency=(Residency("host", first_host, 31),),
        ttl_ms=60_000,
    )


async def filled() -> MemoryState:
    # 30 matched keys in three runs of distinct shapes, then a miss.
    state = MemoryState()
    for n, key in enumerate(KEYS[:30]):
        holders = (H1,) if n < 10 else (H1, H2) if n < 20 else (H2,)
        for holder in holders:
            await state.put(record(key, holder, first_host=0 if n < 25 else 16), 60_000)
    return state


POLICY = Policy.from_json(
    {
        "principals": {
            "urn:kvstore:alice": {"read_scopes": ["*"]},
            **{
                f"urn:kvstore:ii{n}": {
                    "roles": ["instance"],
                    "instance": uri,
                    "write_scopes": [SCOPE],
                }
                for n, uri in ((1, II1), (2, II2))
            },
        }
    }
)


async def _post(app: Any, certs: Path, path: str, body: dict[str, Any]) -> httpx.Response:
    wrapped = AsPrincipal(app, (certs / "client-alice.pem").read_text())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(wrapped), base_url="https://kv.test/"
    ) as client:
        return await client.post(path, json=body)


@pytest.mark.parametrize("shapes_only", [True, False])
async def test_the_in_process_answer_is_the_is_answer(certs: Path, shapes_only: bool) -> None:
    state = await filled()
    index_app = create_index(IndexSettings("https://kv.test/is/"), state, POLICY)
    query = LookupRequest(SCOPE, COMPAT, tuple(KEYS), shapes_only=shapes_only)
    response = await _post(index_app, certs, "is/lookup", query.to_json())
    assert response.status_code == 200, response.text
    over_http = LookupResponse.from_json(response.json())
    local = LocalIndex(state, role_of(index_app).counters)
    here = await local.lookup(query)
    assert here.matched == over_http.matched == 30
    assert here.shapes is not None
    if shapes_only:
        assert over_http.shapes is not None
        assert here.shapes.counts() == over_http.shapes.counts()
    # H1 | H1 and H2 | H2 | H2 with layers 16-31 only: four groups, in order.
    assert [(len(g), n) for g, n in here.shapes.counts()] == [(1, 10), (2, 10), (1, 5), (1, 5)]
    if not shapes_only:
        assert here.replicas == over_http.replicas
    # The IS's own figures count the lookups asked in process too (OPS1).
    counters = role_of(index_app).counters
    assert (counters.lookups, counters.lookup_matched_keys) == (2, 60)
    # A group of shapes is parsed once and kept.
    again = await local.lookup(query)
    assert again.shapes is not None and again.shapes.groups[0] is here.shapes.groups[0]


async def test_place_with_the_is_in_process_and_compact_keys(certs: Path) -> None:
    pc = MemoryControllerState()
    await pc.put_status(status(II1, Link(H1, 100000.0, 10.0)))
    await pc.put_status(status(II2, Link(H2, 100000.0, 10.0)))
    settings = ControllerSettings("https://kv.test/pc/", block_tokens={COMPAT: 4})
    app = create_app(settings, pc, POLICY, LocalIndex(await filled()))
    listed = {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": KEYS}
    packed = b"".join(bytes.fromhex(k) for k in KEYS)
    compact = {
        "scope_id": SCOPE,
        "compat_id": COMPAT,
        "block_keys_b64": base64.b64encode(packed).decode(),
    }
    first = await _post(app, certs, "pc/place", listed)
    second = await _post(app, certs, "pc/place", compact)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json() == second.json()
    assert first.json()["matched"] == 30 and first.json()["index"] == "ok"
    # Bad compact keys are a 400 problem, as bad hex keys are.
    for bad in (
        {**compact, "block_keys": KEYS},
        {**compact, "block_keys_b64": "***"},
        {**compact, "block_keys_b64": base64.b64encode(packed[:-1]).decode()},
        {**compact, "block_keys_b64": ""},
        {**compact, "block_keys_b64": 7},
    ):
        response = await _post(app, certs, "pc/place", bad)
        assert response.status_code == 400, (bad, response.text)
        assert response.headers["content-type"] == "application/problem+json"
    # The keys' octets themselves: a JSON header line, then 32 octets a key.
    header = json.dumps({"scope_id": SCOPE, "compat_id": COMPAT}).encode()
    wrapped = AsPrincipal(app, (certs / "client-alice.pem").read_text())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(wrapped), base_url="https://kv.test/"
    ) as client:
        octets = {"content-type": "application/octet-stream"}
        third = await client.post("pc/place", content=header + b"\n" + packed, headers=octets)
        assert third.status_code == 200, third.text
        assert third.json() == first.json()
        for bad_body in (
            header + packed,
            b"{]\n" + packed,
            header + b"\n" + packed[:-3],
            b'{"scope_id": 1}\n' + packed,
            json.dumps({**listed}).encode() + b"\n" + packed,
        ):
            response = await client.post("pc/place", content=bad_body, headers=octets)
            assert response.status_code == 400, (bad_body[:40], response.text)
    few = create_app(
        dataclasses.replace(settings, max_place_keys=8), pc, POLICY, LocalIndex(await filled())
    )
    response = await _post(few, certs, "pc/place", compact)
    assert response.status_code == 400 and "at most 8 keys" in response.json()["detail"]


def test_the_is_is_asked_in_process_when_both_roles_run_here(tmp_path: Path) -> None:
    config = Config()  # the defaults: no controller.index_uri
    assert index_in_process(config, ("pc", "index"))
    assert not index_in_process(config, ("pc",)) and not index_in_process(config, ("index",))
    named = dataclasses.replace(
        config, controller=dataclasses.replace(config.controller, index_uri=config.index.uri)
    )
    assert index_in_process(named, ("pc", "index"))
    elsewhere = dataclasses.replace(
        config,
        controller=dataclasses.replace(config.controller, index_uri="https://other-is.test/is/"),
    )
    assert not index_in_process(elsewhere, ("pc", "index"))
