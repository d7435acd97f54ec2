"""The body of our ``POST generate`` (not KVSP) and the samplers it names."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..protocol._json import Obj, token_list
from ..protocol.control import MAX_STOP_TOKENS, Sampler
from ..protocol.problems import BadRequest

SAMPLERS = ("greedy", "top-p")


def check_sampler(method: str, params: dict[str, Any], path: str) -> dict[str, Any]:
    """The sampler's params, checked (BadRequest otherwise)."""
    if method not in SAMPLERS:
        raise BadRequest(f"{path}.method: greedy or top-p, not {method!r}")
    if method == "greedy":
        return {}
    p = Obj(params, f"{path}.params")
    return {
        "p": p.number("p", default=1.0, lo=1e-6, hi=1.0),
        "temperature": p.number("temperature", default=1.0, lo=1e-3, hi=100.0),
    }


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Body of our ``POST generate`` (not KVSP)."""

    session: str
    scope_id: str
    tokens: tuple[int, ...]
    max_tokens: int
    sampler: Sampler
    stop_tokens: tuple[int, ...] = ()
    request_ref: str | None = None
    logprobs: bool = False

    @classmethod
    def from_json(cls, value: Any, *, max_prompt: int, max_output: int) -> GenerateRequest:
        obj = Obj(value, "generate")
        session = obj.uuid("session") if "session" in obj else str(uuid.uuid4())
        tokens = token_list(obj, "tokens", max_items=max_prompt)
        if not tokens:
            raise BadRequest("generate.tokens: at least one prompt token")
        sampler = obj.value.get("sampler") or {"method": "greedy"}
        spec = Obj(sampler, "generate.sampler")
        method = spec.name("method", frozenset(SAMPLERS))
        params = sampler.get("params") or {}
        if not isinstance(params, dict):
            raise BadRequest("generate.sampler.params: must be a JSON object")
        params = check_sampler(method, params, "generate.sampler")
        request_ref = obj.text("request_ref", None, max_len=256)
        return cls(
            session=session,
            scope_id=obj.hex16("scope_id"),
            tokens=tokens,
            max_tokens=obj.integer("max_tokens", default=min(64, max_output), lo=1, hi=max_output),
            sampler=Sampler(
                method,
                spec.integer("seed", default=0, lo=0, hi=2**63 - 1),
                0,
                method == "greedy",
                dict(params),
            ),
            stop_tokens=token_list(obj, "stop_tokens", default=[], max_items=MAX_STOP_TOKENS),
            request_ref=request_ref,
            logprobs=obj.flag("logprobs", default=False),
        )
