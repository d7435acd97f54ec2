"""A session's own record (what it generated, its epoch and checkpoints)
and the counters of all of them; :mod:`.sessions` runs them under the
instance's settings (:class:`kvstore.settings.InstanceSettings`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..protocol.control import GenerationLimits, Sampler, SessionCheckpoint
from ..protocol.keys import BlockKeyChain
from ..protocol.problems import LeaseQuota
from .session_state import ENDED, SessionEvent, SessionState, advance

if TYPE_CHECKING:
    from .engine import Generation

PLACEHOLDER = 0  # stands for prompt tokens a resumed session has only as KV


class TooManySessions(LeaseQuota):
    """The instance's bound on open sessions (429)."""

    title = "Too many sessions"


@dataclass
class Session:
    id: str
    scope_id: str
    compat_id: str
    epoch: int
    sampler: Sampler
    limits: GenerationLimits
    #: The sequence so far: prompt, then output (``PLACEHOLDER`` where a
    #: resumed session has only the KV of prompt blocks).
    tokens: list[int]
    prompt_tokens: int
    block_tokens: int
    #: Blocks before the prompt's last token (the checkpoint's prompt_blocks).
    prompt_blocks: int
    #: Output tokens computed so far (all of them, from index 0).
    generated: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    #: Output tokens the followers may see (index < released).
    released: int = 0
    #: The highest output_offset the PC acknowledged (CK3).
    checkpointed: int = 0
    #: running, done, moved (a newer epoch elsewhere, CK7) or failed; changed
    #: only by :meth:`apply` (the table of :mod:`.session_state`).
    state: SessionState = SessionState.RUNNING
    detail: str = ""
    #: Block keys of the sequence's complete blocks, hex, in order.
    keys: list[str] = field(default_factory=list)
    chain: BlockKeyChain | None = field(default=None, repr=False)
    generation: Generation | None = field(default=None, repr=False)
    stats: dict[str, Any] = field(default_factory=dict)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def apply(self, event: SessionEvent, detail: str = "") -> None:
        """The session ends by ``event`` (:func:`.session_state.advance`)."""
        self.state = advance(self.state, event)
        self.detail = detail

    def checkpoint(self) -> SessionCheckpoint:
        start = self.prompt_blocks * self.block_tokens
        return SessionCheckpoint(
            session=self.id,
            epoch=self.epoch,
            compat_id=self.compat_id,
            scope_id=self.scope_id,
            prompt_blocks=tuple(self.keys[: self.prompt_blocks]),
            prompt_tail=tuple(self.tokens[start : self.prompt_tokens]),
            generated=tuple(self.generated),
            output_offset=len(self.generated),
            sampler=Sampler(
                self.sampler.method,
                self.sampler.seed,
                len(self.generated),
                self.sampler.deterministic,
                dict(self.sampler.params),
            ),
            limits=self.limits,
        )

    def head(self) -> dict[str, Any]:
        return {
            "event": "session",
            "session": self.id,
            "epoch": self.epoch,
            "resumed_from": self.stats.get("resumed_from"),
        }

    def end(self) -> dict[str, Any]:
        if self.state is SessionState.DONE:
            return {
                "event": "done",
                "epoch": self.epoch,
                "output_tokens": len(self.generated),
                "stats": dict(self.stats),
            }
        if self.state is SessionState.MOVED:
            return {"event": "moved", "epoch": self.epoch, "detail": self.detail}
        return {"event": "error", "epoch": self.epoch, "detail": self.detail}

    def event(self, index: int) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index, "epoch": self.epoch, "token": self.generated[index]}
        logprob = self.logprobs[index] if index < len(self.logprobs) else None
        if logprob is not None:
            out["logprob"] = logprob
        return out

    @property
    def finished(self) -> bool:
        return self.state in ENDED


@dataclass(slots=True)
class SessionCounters:
    """OPS1 figures of the instance: fetched (loaded) versus recomputed tokens."""

    sessions: int = 0
    resumed: int = 0
    moved: int = 0
    failed: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    output_tokens: int = 0
    checkpoints: int = 0
    checkpoint_failures: int = 0
