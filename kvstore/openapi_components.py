"""The shared pieces of the OpenAPI documents (kvstore.openapi): media
types, scalar schemas and every record's schema, so the four role
documents agree."""

from __future__ import annotations

from typing import Any

JSON = "application/kvsp+json"
PROBLEM = "application/problem+json"
BLOCK = "application/kvsp-block"
ROLES = ("holder", "index", "controller", "instance")

HEX16 = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
HEX32 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
DIGEST = {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"}
URI = {"type": "string", "format": "uri"}
UUID = {"type": "string", "format": "uuid"}
U32 = {"type": "integer", "minimum": 0, "maximum": 4294967295}
TOKENS = {"type": "array", "items": U32}
RANGE = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 2, "maxItems": 2}

COMPONENTS: dict[str, Any] = {
    "Problem": {
        "type": "object",
        "description": "RFC 9457 problem details (H3); KVSP types are "
        "https://iana.org/assignments/kvsp#<suffix>",
        "properties": {
            "type": {"type": "string"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
        },
        "required": ["type", "title", "status"],
    },
    "Residency": {
        "type": "object",
        "properties": {
            "tier": {"type": "string"},
            "layers": RANGE,
            "read_mbit_per_s": {"type": ["number", "null"]},
        },
        "required": ["tier", "layers"],
    },
    "ReplicaRecord": {
        "type": "object",
        "description": "R2",
        "properties": {
            "block_key": HEX32,
            "compat_id": HEX32,
            "scope_id": HEX16,
            "holder": URI,
            "codec": {"type": "integer"},
            "size": {"type": "integer"},
            "digest": DIGEST,
            "layer_digests": {"type": ["array", "null"], "items": HEX32},
            "residency": {"type": "array", "items": {"$ref": "#/components/schemas/Residency"}},
            "ttl_ms": {"type": "integer"},
            "moqt_namespace": {"type": ["string", "null"]},
        },
        "required": [
            "block_key",
            "compat_id",
            "scope_id",
            "holder",
            "codec",
            "size",
            "digest",
            "residency",
            "ttl_ms",
        ],
    },
    "LeaseRequest": {
        "type": "object",
        "properties": {
            "block_keys": {"type": "array", "items": HEX32, "minItems": 1},
            "ttl_ms": {"type": "integer", "minimum": 1},
            "scope_id": HEX16,
            "compat_id": HEX32,
        },
        "required": ["block_keys", "ttl_ms"],
    },
    "LeaseGrant": {
        "type": "object",
        "properties": {
            "lease": {"type": "string"},
            "ttl_ms": {"type": "integer"},
            "block_keys": {"type": "array", "items": HEX32},
        },
        "required": ["lease", "ttl_ms"],
    },
    "LookupRequest": {
        "type": "object",
        "description": "L1; shapes_only is ours",
        "properties": {
            "scope_id": HEX16,
            "compat_id": HEX32,
            "block_keys": {"type": "array", "items": HEX32},
            "targets": {"type": ["array", "null"], "items": URI},
            "shapes_only": {"type": ["boolean", "null"]},
        },
        "required": ["scope_id", "compat_id", "block_keys"],
    },
    "PlaceRequest": {
        "type": "object",
        "description": "ours: the keys as block_keys (hex) or block_keys_b64 (base64 of "
        "their 32 octets each, concatenated), not both",
        "properties": {
            "scope_id": HEX16,
            "compat_id": HEX32,
            "block_keys": {"type": "array", "items": HEX32},
            "block_keys_b64": {"type": "string", "contentEncoding": "base64"},
            "tokens": {"type": "integer", "minimum": 0},
            "request_ref": {"type": "string", "maxLength": 256},
        },
        "required": ["scope_id", "compat_id"],
    },
    "LookupResponse": {
        "type": "object",
        "properties": {
            "matched": {"type": "integer", "minimum": 0},
            "replicas": {
                "type": "array",
                "items": {"type": "array", "items": {"$ref": "#/components/schemas/ReplicaRecord"}},
            },
            "targets": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "instance": URI,
                        "fetch_us": {"type": ["number", "null"]},
                        "recompute_us": {"type": ["number", "null"]},
                    },
                },
            },
            "shapes": {"type": "object"},
            "resident": {
                "type": "array",
                "description": "ours: instances holding a prefix of the keys in their own "
                "memory (residency); never sources to fetch from",
                "items": {
                    "type": "object",
                    "properties": {
                        "instance": URI,
                        "prefix_blocks": {"type": "integer", "minimum": 1},
                        "media": {"type": "array", "items": {"enum": ["GPU", "CPU", "STORAGE"]}},
                    },
                    "required": ["instance", "prefix_blocks", "media"],
                },
            },
        },
        "required": ["matched"],
    },
    "ResidencyGroup": {
        "type": "object",
        "properties": {
            "scope_id": HEX16,
            "compat_id": HEX32,
            "medium": {"enum": ["GPU", "CPU", "STORAGE"]},
            "block_keys": {"type": "array", "items": HEX32},
        },
        "required": ["scope_id", "compat_id", "medium", "block_keys"],
    },
    "ResidencyUpdate": {
        "type": "object",
        "description": "ours (docs/events.md): what an instance holds in its own memory",
        "properties": {
            "instance": URI,
            "ttl_ms": {"type": "integer", "minimum": 1},
            "clear": {"type": "boolean"},
            "add": {"type": "array", "items": {"$ref": "#/components/schemas/ResidencyGroup"}},
            "remove": {"type": "array", "items": {"$ref": "#/components/schemas/ResidencyGroup"}},
        },
        "required": ["instance", "ttl_ms"],
    },
    "ResidencyAnswer": {
        "type": "object",
        "properties": {
            "ttl_ms": {"type": "integer", "minimum": 1},
            "known": {"type": "boolean"},
            "records": {"type": "integer", "minimum": 0},
        },
        "required": ["ttl_ms", "known", "records"],
    },
    "InstanceStatus": {
        "type": "object",
        "description": "R3",
        "properties": {
            "instance": URI,
            "epoch": {"type": "integer", "minimum": 0},
            "state": {"enum": ["active", "draining", "sleeping", "failed"]},
            "running": U32,
            "queued": U32,
            "batch_size": U32,
            "kv_utilization": {"type": "number", "minimum": 0, "maximum": 1},
            "prefill_tokens_per_s": {"type": "number", "minimum": 0},
            "decode_tokens_per_s": {"type": "number", "minimum": 0},
            "links": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "holder": URI,
                        "mbit_per_s": {"type": "number"},
                        "rtt_us": {"type": "number"},
                    },
                    "required": ["holder", "mbit_per_s", "rtt_us"],
                },
            },
            "requested_state": {"enum": ["active", "draining", "sleeping", "failed", None]},
            "ttl_ms": {"type": "integer", "minimum": 1},
        },
        "required": [
            "instance",
            "epoch",
            "state",
            "running",
            "queued",
            "batch_size",
            "kv_utilization",
            "prefill_tokens_per_s",
            "decode_tokens_per_s",
            "ttl_ms",
        ],
    },
    "StateChange": {
        "type": "object",
        "properties": {"state": {"enum": ["active", "draining", "sleeping", "failed"]}},
        "required": ["state"],
    },
    "Sampler": {
        "type": "object",
        "properties": {
            "method": {"type": "string"},
            "params": {"type": ["object", "null"]},
            "seed": {"type": "integer"},
            "step": {"type": "integer", "minimum": 0},
            "deterministic": {"type": "boolean"},
        },
        "required": ["method", "seed", "step", "deterministic"],
    },
    "SessionCheckpoint": {
        "type": "object",
        "description": "R4; kvstore_limits is ours",
        "properties": {
            "session": UUID,
            "epoch": {"type": "integer", "minimum": 0},
            "compat_id": HEX32,
            "scope_id": HEX16,
            "prompt_blocks": {"type": "array", "items": HEX32},
            "prompt_tail": TOKENS,
            "generated": TOKENS,
            "output_offset": {"type": "integer", "minimum": 0},
            "sampler": {"$ref": "#/components/schemas/Sampler"},
            "kvstore_limits": {
                "type": "object",
                "properties": {"max_tokens": U32, "stop_tokens": TOKENS},
            },
        },
        "required": [
            "session",
            "epoch",
            "compat_id",
            "scope_id",
            "prompt_blocks",
            "prompt_tail",
            "generated",
            "output_offset",
            "sampler",
        ],
    },
    "ShardMap": {
        "type": "object",
        "description": "RS1",
        "properties": {
            "map": {"type": "string"},
            "version": {"type": "integer", "minimum": 0},
            "shards": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"tokens": RANGE, "instance": URI},
                    "required": ["tokens", "instance"],
                },
            },
        },
        "required": ["map", "version", "shards"],
    },
    "Reshard": {
        "type": "object",
        "description": "RS2 plan {map, from, to, deadline_ms, retain, fetch, release}, "
        "or {map, commit}, or {map, abort}",
        "properties": {
            "map": {"type": "string"},
            "from": {"type": "integer"},
            "to": {"type": "integer"},
            "deadline_ms": {"type": "integer"},
            "retain": {"type": "array", "items": RANGE},
            "fetch": {
                "type": "array",
                "items": {"type": "object", "properties": {"tokens": RANGE, "from": URI}},
            },
            "release": {"type": "array", "items": RANGE},
            "commit": {"type": "integer"},
            "abort": {"type": "integer"},
        },
        "required": ["map"],
    },
    "PrefetchDirective": {
        "type": "object",
        "description": "PF1",
        "properties": {
            "directive": UUID,
            "request_ref": {"type": ["string", "null"]},
            "scope_id": HEX16,
            "compat_id": HEX32,
            "blocks": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"block_key": HEX32, "sources": {"type": "array", "items": URI}},
                    "required": ["block_key", "sources"],
                },
            },
            "layer_order": {"const": "ascending"},
            "deadline_ms": {"type": "integer", "minimum": 0},
            "lease_ms": {"type": "integer", "minimum": 0},
        },
        "required": ["directive", "scope_id", "compat_id", "blocks", "deadline_ms", "lease_ms"],
    },
    "PrefetchStatus": {
        "type": "object",
        "properties": {
            "directive": UUID,
            "state": {"enum": ["pending", "partial", "complete", "failed"]},
            "loaded": {"type": "array", "items": HEX32},
        },
        "required": ["directive", "state", "loaded"],
    },
    "Shards": {
        "type": "object",
        "properties": {"holders": {"type": "array", "items": URI, "minItems": 1}, "self": URI},
        "required": ["holders", "self"],
    },
    "Object": {"type": "object", "description": "a JSON object described in the docs"},
}
