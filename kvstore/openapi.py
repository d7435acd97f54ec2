"""OpenAPI 3.1 documents of every role's resources (``docs/openapi/``).

Built here from shared pieces (records, problems) so that the four
documents agree; ``kvstore openapi ROLE`` prints one, and
``tests/test_openapi.py`` checks that docs/openapi/ holds what this builds
and runs schemathesis against each role's app: no 5xx on any generated
input, and every response matches its schema. Paths are relative to the
role's base URI, as in the draft; our own resources (not KVSP) say so.
"""

from __future__ import annotations

import json
from typing import Any

from .openapi_components import (
    BLOCK,
    COMPONENTS,
    HEX16,
    HEX32,
    JSON,
    PROBLEM,
    ROLES,
)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict[str, Any]:
    return {"content": {JSON: {"schema": _ref(name)}}}


def _op(
    summary: str,
    ok: dict[str, Any],
    body: str | None = None,
    body_type: str = JSON,
    ours: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """An operation: its 2xx answers in ``ok``, any error a problem (default)."""
    op: dict[str, Any] = {
        "summary": summary + (" (ours, not KVSP)" if ours else ""),
        "responses": {
            **ok,
            "default": {
                "description": "a problem (H3)",
                "content": {PROBLEM: {"schema": _ref("Problem")}},
            },
        },
        **extra,
    }
    if body is not None:
        schema = _ref(body) if body_type == JSON else {"type": "string", "format": "binary"}
        op["requestBody"] = {"required": True, "content": {body_type: {"schema": schema}}}
    return op


def _path(*names: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": n, "in": "path", "required": True, "schema": s} for n, s in names]


def _ok(code: str, name: str | None, description: str = "done") -> dict[str, Any]:
    return {code: {"description": description, **(_json(name) if name else {})}}


def document(role: str) -> dict[str, Any]:
    if role not in ROLES:
        raise ValueError(f"role {role!r}: one of {', '.join(ROLES)}")
    paths: dict[str, Any] = {}
    block = _path(("compat", HEX32), ("scope", HEX16), ("block_key", HEX32))
    if role == "holder":
        paths["/blocks/{compat}/{scope}/{block_key}"] = {
            "parameters": block,
            "get": _op(
                "Retrieve a block, or a layer range of it (BL1-BL4)",
                {
                    "200": {
                        "description": "the KV Block Container",
                        "content": {BLOCK: {"schema": {"type": "string", "format": "binary"}}},
                    }
                },
                parameters=[
                    {
                        "name": "layers",
                        "in": "query",
                        "schema": {"type": "string", "pattern": "^[0-9]+-[0-9]+$"},
                    },
                    {"name": "codec", "in": "query", "schema": {"type": "integer"}},
                ],
            ),
            "put": _op(
                "Store a block with If-None-Match: * (BL7)",
                _ok("201", "ReplicaRecord", "stored; the replica's record"),
                "Object",
                body_type=BLOCK,
                parameters=[
                    {
                        "name": "If-None-Match",
                        "in": "header",
                        "required": True,
                        "schema": {"const": "*"},
                    }
                ],
            ),
            "delete": _op(
                "An operator removes a block, withdrawn from the IS first (P3); "
                "the admin role only; a leased block is a 412 unless force=true",
                {"204": {"description": "removed"}},
                ours=True,
                parameters=[{"name": "force", "in": "query", "schema": {"type": "boolean"}}],
            ),
        }
        paths["/scopes/{scope}"] = {
            "parameters": _path(("scope", HEX16)),
            "delete": _op(
                "An operator purges a scope: every block of it removed, each "
                "withdrawn first (P3); the admin role only; leased blocks stay "
                "unless force=true",
                _ok("200", "Object", "how many went, and how many leased ones stayed"),
                ours=True,
                parameters=[{"name": "force", "in": "query", "schema": {"type": "boolean"}}],
            ),
        }
        paths["/leases"] = {
            "post": _op("Create a lease (LE1)", _ok("201", "LeaseGrant"), "LeaseRequest")
        }
        lease = _path(("lease_id", {"type": "string"}))
        paths["/leases/{lease_id}"] = {
            "parameters": lease,
            "put": _op("Renew a lease", _ok("200", "LeaseGrant"), "Object"),
            "delete": _op("Release a lease", {"204": {"description": "released"}}),
        }
        paths["/shards"] = {
            "get": _op(
                "The base URIs of every worker of this holder process (docs/workers.md)",
                _ok("200", "Shards"),
                ours=True,
            ),
        }
    elif role == "index":
        paths["/replicas/{holder_id}/{block_key}"] = {
            "parameters": _path(("holder_id", {"type": "string"}), ("block_key", HEX32)),
            "put": _op(
                "Publish a replica record (P1, L4)",
                {
                    "200": {"description": "kept; the granted TTL", **_json("Object")},
                    "204": {"description": "kept"},
                },
                "ReplicaRecord",
            ),
            "delete": _op("Withdraw a replica record (P3)", {"204": {"description": "gone"}}),
        }
        paths["/lookup"] = {
            "post": _op(
                "Longest-prefix lookup (L1-L3)", _ok("200", "LookupResponse"), "LookupRequest"
            )
        }
        paths["/residency/{instance_id}"] = {
            "parameters": _path(("instance_id", {"type": "string"})),
            "post": _op(
                "An instance tells what it holds in its own memory (an engine's bridge, "
                "kvstore events): additions, removals, a clear, its records' TTL",
                _ok("200", "ResidencyAnswer"),
                "ResidencyUpdate",
                ours=True,
            ),
        }
    elif role == "controller":
        instance_id = _path(("instance_id", {"type": "string"}))
        session = _path(("session", {"type": "string"}))
        map_id = _path(("map", {"type": "string"}))
        paths["/instances"] = {
            "get": _op("Every instance and the state the PC holds", _ok("200", "Object"), ours=True)
        }
        paths["/instances/{instance_id}/status"] = {
            "parameters": instance_id,
            "put": _op(
                "Report an instance's status (S1-S3)", _ok("200", "StateChange"), "InstanceStatus"
            ),
        }
        paths["/instances/{instance_id}/state"] = {
            "parameters": instance_id,
            "put": _op(
                "Set an instance active or draining",
                _ok("200", "StateChange"),
                "StateChange",
                ours=True,
            ),
        }
        paths["/sessions/{session}/checkpoint"] = {
            "parameters": session,
            "put": _op(
                "Checkpoint a session (CK1, CK2)", _ok("200", "Object"), "SessionCheckpoint"
            ),
        }
        paths["/sessions/{session}"] = {
            "parameters": session,
            "get": _op("Where a session is now", _ok("200", "Object"), ours=True),
            "delete": _op("The owner ends a session", {"204": {"description": "ended"}}, ours=True),
        }
        paths["/maps/{map}"] = {
            "parameters": map_id,
            "put": _op("Hold a shard map (RS1)", _ok("200", "ShardMap"), "ShardMap", ours=True),
            "get": _op("A shard map", _ok("200", "Object"), ours=True),
        }
        paths["/maps/{map}/reshard"] = {
            "parameters": map_id,
            "post": _op(
                "Reshard to a target map (RS2-RS7)", _ok("200", "Object"), "Object", ours=True
            ),
        }
        place = _op("Place a request (PL1-PL3)", _ok("200", "Object"), "PlaceRequest", ours=True)
        place["requestBody"]["content"]["application/octet-stream"] = {
            "schema": {
                "type": "string",
                "format": "binary",
                "description": "the keys packed: a PlaceRequest without block_keys as one JSON "
                "line, a newline, then each block key as 32 raw octets",
            }
        }
        paths["/place"] = {"post": place}
    else:
        session = _path(("session", {"type": "string"}))
        paths["/prefetch"] = {
            "post": _op(
                "A prefetch directive (PF1)",
                {
                    "202": {
                        "description": "accepted; Location names its status",
                        **_json("PrefetchStatus"),
                    }
                },
                "PrefetchDirective",
            )
        }
        paths["/prefetch/{directive}"] = {
            "parameters": _path(("directive", {"type": "string"})),
            "get": _op("A directive's state (PF3)", _ok("200", "PrefetchStatus")),
        }
        paths["/state"] = {
            "put": _op("Change the state (S3, S6)", _ok("200", "StateChange"), "StateChange")
        }
        paths["/sessions/{session}/resume"] = {
            "parameters": session,
            "post": _op("Resume a session (CK5, CK6)", _ok("200", "Object"), "Object"),
        }
        paths["/reshard"] = {
            "post": _op(
                "A reshard plan, commit or abort (RS2-RS6)", _ok("200", "Object"), "Reshard"
            )
        }
        paths["/contexts/{map}"] = {
            "parameters": _path(("map", {"type": "string"})),
            "put": _op(
                "Hold ranges of a sharded context", _ok("200", "Object"), "Object", ours=True
            ),
            "get": _op("What is held of a context", _ok("200", "Object"), ours=True),
        }
        ndjson = {
            "200": {
                "description": "NDJSON events: session, tokens (index, epoch), end",
                "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
            }
        }
        paths["/generate"] = {
            "post": _op("Start a session and stream its tokens", ndjson, "Object", ours=True)
        }
        paths["/sessions/{session}"] = {
            "parameters": session,
            "get": _op("How a session stands", _ok("200", "Object"), ours=True),
        }
        paths["/sessions/{session}/tokens"] = {
            "parameters": session,
            "get": _op(
                "A session's tokens again, from an index",
                ndjson,
                ours=True,
                parameters=[
                    {"name": "from", "in": "query", "schema": {"type": "integer", "minimum": 0}}
                ],
            ),
        }
    titles = {
        "holder": "KVSP holder",
        "index": "KVSP Index Service",
        "controller": "KVSP Placement Controller",
        "instance": "KVSP Inference Instance",
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"{titles[role]} (kvstore)",
            "version": "1",
            "description": "Paths are relative to the role's base URI. Every request "
            "authenticates with a client certificate (mutual TLS 1.3, H1).",
        },
        "paths": paths,
        "components": {"schemas": COMPONENTS},
    }


def render(role: str) -> str:
    return json.dumps(document(role), indent=1, sort_keys=True) + "\n"
