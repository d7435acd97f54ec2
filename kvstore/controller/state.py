"""What the Placement Controller knows: instances, their epochs, sessions.

:class:`ControllerState` applies the rules of :mod:`.rules` over a few
storage primitives, which :class:`MemoryControllerState` (one process) and
:class:`~.redis_state.RedisControllerState` (several PC and IS processes
sharing a Redis, or a PC that restarts) implement. Each primitive changes
one entry atomically: a rule sees the entry as it is and its result replaces
exactly that, or the change is retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..protocol.control import InstanceStatus, SessionCheckpoint, ShardMap
from ..protocol.lifecycle import InstanceState
from ..protocol.problems import (
    InsufficientStorage,
    InvalidState,
    NotFound,
    StaleEpoch,
    UnknownResource,
)
from ..protocol.wire import role_id
from .rules import (
    InstanceEntry,
    MapEntry,
    SessionEntry,
    SleepPolicy,
    after_assign,
    after_checkpoint,
    after_map_created,
    after_reshard_ended,
    after_reshard_started,
    after_set,
    after_status,
    check_end,
)

__all__ = ["ControllerState", "MemoryControllerState", "SleepPolicy"]

InstanceChange = Callable[[InstanceEntry | None, float], InstanceEntry]
MapChange = Callable[[MapEntry | None, float], MapEntry]
SessionChange = Callable[[SessionEntry | None, float], SessionEntry]


class SessionsFull(InsufficientStorage):
    title = "Too many sessions"


@dataclass(kw_only=True)
class ControllerState:
    """The PC's rules over storage primitives a subclass provides."""

    sleep_policy: SleepPolicy = field(default_factory=SleepPolicy)
    #: Bounds on what instances can make the PC remember (hostile input).
    max_sessions: int = 100_000
    max_sessions_per_owner: int = 10_000
    #: How long an ended session is remembered: its old owner, fenced by a
    #: later epoch, must not start it again at epoch 1 (CK7).
    ended_ttl_s: float = 3600.0

    # --- storage primitives -------------------------------------------------

    async def now(self) -> float:
        """The state's clock (seconds)."""
        raise NotImplementedError

    async def _instance(self, instance: str) -> tuple[InstanceEntry | None, float]:
        """The instance's entry and the state's clock now."""
        raise NotImplementedError

    async def _instances(self) -> tuple[list[InstanceEntry], float]:
        raise NotImplementedError

    async def _change_instance(self, instance: str, change: InstanceChange) -> InstanceEntry:
        """Replace the entry by ``change(entry, now)``, atomically."""
        raise NotImplementedError

    async def _session(self, session: str) -> SessionEntry | None:
        raise NotImplementedError

    async def _change_session(self, session: str, change: SessionChange) -> SessionEntry:
        """Replace the entry by ``change(entry, now)``, atomically, within the
        session quotas (a new session, or one moving to another owner)."""
        raise NotImplementedError

    async def _drop_session(
        self, session: str, check: Callable[[SessionEntry | None], object]
    ) -> None:
        """Remove the entry if ``check(entry)`` does not raise, atomically."""
        raise NotImplementedError

    async def _sessions_of(self, owner: str) -> list[SessionEntry]:
        raise NotImplementedError

    async def _ended_entry(self, session: str) -> SessionEntry | None:
        """The entry of a session that ended (while its tombstone lasts)."""
        raise NotImplementedError

    async def _map(self, map_id: str) -> MapEntry | None:
        raise NotImplementedError

    async def _change_map(self, map_id: str, change: MapChange) -> MapEntry:
        """Replace the entry by ``change(entry, now)``, atomically."""
        raise NotImplementedError

    async def close(self) -> None:
        pass

    # --- status and lifecycle -----------------------------------------------

    async def put_status(self, status: InstanceStatus) -> InstanceState:
        """Record a status report; returns the state to answer with (S2, S3)."""
        entry = await self._change_instance(
            status.instance, lambda e, now: after_status(e, status, now, self.sleep_policy)
        )
        return entry.state

    async def state_of(self, instance: str) -> InstanceState:
        """The instance's lifecycle state; ``failed`` once its record expired (S1)."""
        entry, now = await self._instance(instance)
        if entry is None:
            raise UnknownResource("unknown instance")
        return entry.state_at(now)

    async def set_state(self, instance: str, state: InstanceState | str) -> None:
        """The PC's own decision (what it sends with ``PUT state``, S3/S6)."""
        target = InstanceState(state)
        await self._change_instance(instance, lambda e, _: after_set(e, target))

    async def active(self) -> list[InstanceStatus]:
        """Instances that may receive requests and directives (S4)."""
        entries, now = await self._instances()
        return [e.status for e in entries if e.state_at(now) is InstanceState.ACTIVE]

    async def overview(self) -> list[dict[str, Any]]:
        """Every instance the PC knows, with the state it holds and its last
        report (operators: ``GET instances``, ``kvstore status``)."""
        entries, now = await self._instances()
        return [
            {
                "instance": e.status.instance,
                "state": e.state_at(now).value,
                "epoch": e.highest_epoch,
                "expires_in_s": round(e.expires_at - now, 3),
                **{
                    k: v
                    for k, v in e.status.to_json().items()
                    if k
                    in (
                        "running",
                        "queued",
                        "kv_utilization",
                        "prefill_tokens_per_s",
                        "decode_tokens_per_s",
                    )
                },
            }
            for e in sorted(entries, key=lambda e: e.status.instance)
        ]

    async def failed(self) -> list[str]:
        entries, now = await self._instances()
        return [e.status.instance for e in entries if e.state_at(now) is InstanceState.FAILED]

    async def restarted(self) -> list[tuple[str, int]]:
        """Live instances that restarted since their sessions were last moved,
        with their epoch now (CK5)."""
        entries, now = await self._instances()
        return [
            (e.status.instance, e.highest_epoch)
            for e in entries
            if e.restarted and e.state_at(now) is not InstanceState.FAILED
        ]

    async def sessions_moved(self, instance: str, epoch: int) -> None:
        """The sessions of ``instance``'s processes before ``epoch`` are moved."""

        def change(entry: InstanceEntry | None, now: float) -> InstanceEntry:
            if entry is None:
                raise UnknownResource("unknown instance")
            if entry.highest_epoch != epoch:
                return entry  # restarted again meanwhile: still to do
            return replace(entry, restarted=False)

        await self._change_instance(instance, change)

    async def instance_named(self, instance_id: str) -> str:
        """The base URI of the known instance whose id (H6) is ``instance_id``."""
        entries, _ = await self._instances()
        for entry in entries:
            if role_id(entry.status.instance) == instance_id:
                return entry.status.instance
        raise UnknownResource("unknown instance")

    async def require_active(self, instance: str) -> None:
        state = await self.state_of(instance)
        if state is not InstanceState.ACTIVE:
            raise InvalidState(f"instance is {state}, not active (S4)")

    async def statuses(self, instances: Iterable[str]) -> Mapping[str, InstanceStatus]:
        """StatusSource for the Index Service's estimates: active instances only."""
        wanted = set(instances)
        entries, now = await self._instances()
        return {
            e.status.instance: e.status
            for e in entries
            if e.status.instance in wanted and e.state_at(now) is InstanceState.ACTIVE
        }

    # --- sessions and checkpoints -------------------------------------------

    async def _epoch_of(self, instance: str) -> int:
        entry, _ = await self._instance(instance)
        return 0 if entry is None else entry.highest_epoch

    async def assign(
        self,
        session: str,
        owner: str,
        epoch: int = 1,
        owner_epoch: int | None = None,
        keep_touched: bool = False,
    ) -> SessionEntry:
        """A session starts (or resumes, with a higher epoch) on ``owner``
        (whose current process has it, unless ``owner_epoch`` says which)."""
        if owner_epoch is None:
            owner_epoch = await self._epoch_of(owner)
        known = owner_epoch
        return await self._change_session(
            session,
            lambda e, now: after_assign(e, session, owner, epoch, now, known, keep_touched),
        )

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, instance: str) -> SessionEntry:
        """CK2, CK7: keep the highest output_offset of the current epoch."""
        owner_epoch = await self._epoch_of(instance)
        return await self._change_session(
            checkpoint.session,
            lambda e, now: after_checkpoint(e, checkpoint, instance, now, owner_epoch),
        )

    async def end_session(self, session: str, instance: str) -> None:
        """The owner's session is over: it is forgotten, never migrated."""
        await self._drop_session(session, lambda e: check_end(e, instance))

    async def session(self, session: str) -> SessionEntry:
        entry = await self._session(session)
        if entry is None:
            raise NotFound("unknown session")
        return entry

    async def ended(self, session: str) -> SessionEntry:
        """A session that ended: its last owner, epoch and checkpoint."""
        entry = await self._ended_entry(session)
        if entry is None:
            raise NotFound("unknown session")
        return entry

    async def sessions_of(self, instance: str) -> list[SessionEntry]:
        return await self._sessions_of(instance)

    # --- shard maps (RS1, RS5, RS6) -----------------------------------------

    async def create_map(self, shard_map: ShardMap) -> MapEntry:
        """Hold a new map (idempotent for the same map; 409 for another)."""
        return await self._change_map(shard_map.map, lambda e, _: after_map_created(e, shard_map))

    async def shard_map(self, map_id: str) -> MapEntry:
        entry = await self._map(map_id)
        if entry is None:
            raise UnknownResource(f"unknown map {map_id}")
        return entry

    async def begin_reshard(self, target: ShardMap, hold_s: float) -> MapEntry:
        """Mark ``target`` (v+1) in progress; the entry still holds v (RS5)."""
        return await self._change_map(
            target.map, lambda e, now: after_reshard_started(e, target, now, hold_s)
        )

    async def end_reshard(self, target: ShardMap, committed: bool) -> MapEntry:
        return await self._change_map(
            target.map, lambda e, _: after_reshard_ended(e, target, committed)
        )

    def _ended_error(self) -> StaleEpoch:
        return StaleEpoch("the session has ended (CK7)")

    def _quota_error(self, total_full: bool) -> InsufficientStorage:
        if total_full:
            return SessionsFull(f"the PC tracks its maximum of {self.max_sessions} sessions")
        return SessionsFull("this instance has its maximum of open sessions")


@dataclass(kw_only=True)
class MemoryControllerState(ControllerState):
    """Controller state in one process (entries in dicts, a monotonic clock)."""

    clock: Callable[[], float] = time.monotonic
    instances: dict[str, InstanceEntry] = field(default_factory=dict)
    sessions: dict[str, SessionEntry] = field(default_factory=dict)
    maps: dict[str, MapEntry] = field(default_factory=dict)
    _per_owner: dict[str, int] = field(default_factory=dict)
    _ended: dict[str, float] = field(default_factory=dict)  # session -> remembered until
    _ended_entries: dict[str, SessionEntry] = field(default_factory=dict)

    # Nothing below awaits: each change is atomic within the event loop.

    async def now(self) -> float:
        return self.clock()

    async def _instance(self, instance: str) -> tuple[InstanceEntry | None, float]:
        return self.instances.get(instance), self.clock()

    async def _instances(self) -> tuple[list[InstanceEntry], float]:
        return list(self.instances.values()), self.clock()

    async def _change_instance(self, instance: str, change: InstanceChange) -> InstanceEntry:
        entry = change(self.instances.get(instance), self.clock())
        self.instances[instance] = entry
        return entry

    async def _session(self, session: str) -> SessionEntry | None:
        return self.sessions.get(session)

    async def _change_session(self, session: str, change: SessionChange) -> SessionEntry:
        old = self.sessions.get(session)
        now = self.clock()
        if old is None and self._ended.get(session, 0.0) > now:
            raise self._ended_error()
        new = change(old, now)
        if old is None and len(self.sessions) >= self.max_sessions:
            raise self._quota_error(total_full=True)
        if old is None or old.owner != new.owner:
            if self._per_owner.get(new.owner, 0) >= self.max_sessions_per_owner:
                raise self._quota_error(total_full=False)
            if old is not None:
                self._per_owner[old.owner] -= 1
            self._per_owner[new.owner] = self._per_owner.get(new.owner, 0) + 1
        self.sessions[session] = new
        return new

    async def _drop_session(
        self, session: str, check: Callable[[SessionEntry | None], object]
    ) -> None:
        entry = self.sessions.get(session)
        check(entry)
        if entry is not None:
            del self.sessions[session]
            self._per_owner[entry.owner] -= 1
            now = self.clock()
            if len(self._ended) >= self.max_sessions:  # bounded: the oldest go
                for name in [n for n, until in self._ended.items() if until <= now]:
                    del self._ended[name]
                    self._ended_entries.pop(name, None)
                while len(self._ended) >= self.max_sessions:
                    self._ended_entries.pop(oldest := next(iter(self._ended)), None)
                    del self._ended[oldest]
            self._ended[session] = now + self.ended_ttl_s
            self._ended_entries[session] = entry

    async def _sessions_of(self, owner: str) -> list[SessionEntry]:
        return [s for s in self.sessions.values() if s.owner == owner]

    async def _ended_entry(self, session: str) -> SessionEntry | None:
        if self._ended.get(session, 0.0) <= self.clock():
            return None
        return self._ended_entries.get(session)

    async def _map(self, map_id: str) -> MapEntry | None:
        return self.maps.get(map_id)

    async def _change_map(self, map_id: str, change: MapChange) -> MapEntry:
        entry = self.maps[map_id] = change(self.maps.get(map_id), self.clock())
        return entry
