"""The Placement Controller's rules, as pure transitions of its records.

Every state (memory, Redis) stores the same entries and changes them only
through these functions, so the rules hold the same everywhere:

* a status record with a lower epoch than the highest seen for its instance
  is discarded with ``kvsp-stale-epoch`` (S2);
* an instance's state changes only through the table of
  :mod:`kvstore.protocol.lifecycle`; here is when its events happen: the
  first record of a process (a new instance, or a higher epoch) starts it
  (S2, S6), a later record saying ``sleeping`` ends a drain (S5), the PC's
  ``PUT state`` sets it (S3, S6), and a record expired ``ttl_ms`` after it
  arrived reads as failed (S1); no request or directive goes to a
  non-active instance (S4);
* ``requested_state: "sleeping"`` is answered ``draining`` when the
  instance has been idle (running and queued below thresholds) for the
  configured time, else ``active`` (S3);
* a checkpoint keeps the highest ``output_offset`` of the session's current
  epoch; a lower epoch is ``kvsp-stale-epoch``; only the session's current
  owner may checkpoint it (CK2, CK7, SEC5).

Times are seconds on the state's clock (monotonic in one process, the Redis
server's clock for a shared state): never a peer's clock (OPS2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..protocol.control import InstanceStatus, SessionCheckpoint, ShardMap
from ..protocol.lifecycle import STARTED, InstanceEvent, InstanceState, advance, set_by_pc
from ..protocol.problems import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    PlanConflict,
    StaleEpoch,
    UnknownResource,
)


@dataclass(frozen=True, slots=True)
class SleepPolicy:
    """When an instance asking to sleep may (S3)."""

    max_running: int = 0
    max_queued: int = 0
    idle_for_s: float = 60.0


@dataclass(frozen=True, slots=True)
class InstanceEntry:
    status: InstanceStatus
    expires_at: float
    highest_epoch: int
    #: The lifecycle state the PC holds for the instance (it wins over the
    #: reported one while a transition is in progress).
    state: InstanceState
    idle_since: float | None = None
    #: It restarted (a higher epoch, S2) since the PC last moved the sessions
    #: its earlier process owned: those are lost there and to be resumed (CK5).
    restarted: bool = False

    def state_at(self, now: float) -> InstanceState:
        """``failed`` once the record expired (S1), else the held state."""
        if self.expires_at <= now:
            # Not stored: a report of the same process brings back the held state.
            return advance(self.state, InstanceEvent.EXPIRED)
        return self.state

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.to_json(),
            "expires_at": self.expires_at,
            "highest_epoch": self.highest_epoch,
            "state": self.state.value,
            "idle_since": self.idle_since,
            "restarted": self.restarted,
        }

    @classmethod
    def from_json(cls, value: Any, status: InstanceStatus | None = None) -> InstanceEntry:
        """From a shared state's stored JSON (written by :meth:`to_json`);
        ``status``: the already parsed status record, when the caller has it."""
        return cls(
            status=status or InstanceStatus.from_json(value["status"]),
            expires_at=float(value["expires_at"]),
            highest_epoch=int(value["highest_epoch"]),
            state=InstanceState(value["state"]),
            idle_since=None if value["idle_since"] is None else float(value["idle_since"]),
            restarted=bool(value.get("restarted", False)),
        )


@dataclass(frozen=True, slots=True)
class SessionEntry:
    session: str
    epoch: int
    owner: str
    checkpoint: SessionCheckpoint | None = None
    #: When the session was last placed or checkpointed (the state's clock).
    touched: float = 0.0
    #: The owner's epoch (S2) then: a later epoch means a new process that
    #: does not have the session.
    owner_epoch: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "epoch": self.epoch,
            "owner": self.owner,
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
            "touched": self.touched,
            "owner_epoch": self.owner_epoch,
        }

    @classmethod
    def from_json(cls, value: Any) -> SessionEntry:
        checkpoint = value["checkpoint"]
        return cls(
            session=str(value["session"]),
            epoch=int(value["epoch"]),
            owner=str(value["owner"]),
            checkpoint=None if checkpoint is None else SessionCheckpoint.from_json(checkpoint),
            touched=float(value.get("touched", 0.0)),
            owner_epoch=int(value.get("owner_epoch", 0)),
        )


def after_status(
    entry: InstanceEntry | None, status: InstanceStatus, now: float, policy: SleepPolicy
) -> InstanceEntry:
    """The instance's entry once ``status`` is recorded (S2, S3, S5, S6)."""
    if entry is not None and status.epoch < entry.highest_epoch:
        raise StaleEpoch(
            f"epoch {status.epoch} is older than {entry.highest_epoch} for this instance"
        )
    restarted = entry is None or status.epoch > entry.highest_epoch
    reported = InstanceState(status.state)
    if entry is None or restarted:
        # S2: a process the PC has not heard from; the table keeps one the
        # PC put to sleep asleep (S6).
        state = advance(None if entry is None else entry.state, STARTED[reported])
    elif reported is InstanceState.SLEEPING:
        state = advance(entry.state, InstanceEvent.DRAINED)  # S5
    else:
        state = entry.state  # the PC's state wins over the instance's word
    idle = status.running <= policy.max_running and status.queued <= policy.max_queued
    idle_since = None
    if idle:
        previous = entry.idle_since if entry is not None and not restarted else None
        idle_since = previous if previous is not None else now
    # S3: a sleep request of an active instance idle long enough is accepted
    # (answered draining); any other is answered with the state held.
    long_enough = idle_since is not None and now - idle_since >= policy.idle_for_s
    if status.requested_state == "sleeping" and state is InstanceState.ACTIVE and long_enough:
        state = advance(state, InstanceEvent.SLEEP_ACCEPTED)
    return InstanceEntry(
        status=status,
        expires_at=now + status.ttl_ms / 1000,
        highest_epoch=status.epoch,
        state=state,
        idle_since=idle_since,
        # CK5: a restart loses the sessions of the earlier process.
        restarted=entry is not None and (restarted or entry.restarted),
    )


def after_set(entry: InstanceEntry | None, state: InstanceState) -> InstanceEntry:
    """The PC's own decision, what it sends with ``PUT state`` (S3; S6: the
    only way a sleeping instance wakes)."""
    if entry is None:
        raise UnknownResource("unknown instance")
    return dataclasses.replace(entry, state=advance(entry.state, set_by_pc(state)))


def after_assign(
    entry: SessionEntry | None,
    session: str,
    owner: str,
    epoch: int,
    now: float,
    owner_epoch: int = 0,
    keep_touched: bool = False,
) -> SessionEntry:
    """A session starts on ``owner``, or resumes there with a higher epoch (CK5);
    ``keep_touched``: not a sign of life (the PC moving it back to retry)."""
    if entry is not None and epoch <= entry.epoch:
        raise StaleEpoch(f"session is at epoch {entry.epoch}")
    if entry is None and epoch != 1:
        # An unknown session (ended meanwhile) is not resumed into being.
        raise StaleEpoch(f"session is unknown; epoch {epoch} was never assigned")
    checkpoint = entry.checkpoint if entry is not None else None
    touched = entry.touched if keep_touched and entry is not None else now
    return SessionEntry(session, epoch, owner, checkpoint, touched, owner_epoch)


def after_checkpoint(
    entry: SessionEntry | None,
    checkpoint: SessionCheckpoint,
    instance: str,
    now: float,
    owner_epoch: int = 0,
) -> SessionEntry:
    """CK2, CK7, SEC5: keep the highest output_offset of the current epoch."""
    if entry is None:
        # A session the PC has not placed: its first checkpoint registers
        # it, at epoch 1 only (a later epoch is the PC's to hand out).
        if checkpoint.epoch != 1:
            raise Conflict(
                f"epoch {checkpoint.epoch} was never assigned (an unknown session "
                "starts at epoch 1)"
            )
        entry = SessionEntry(checkpoint.session, 1, instance)
    elif entry.checkpoint is not None and (
        (checkpoint.scope_id, checkpoint.compat_id)
        != (entry.checkpoint.scope_id, entry.checkpoint.compat_id)
    ):
        raise BadRequest("a session keeps its scope and compatibility")
    if checkpoint.epoch < entry.epoch:
        raise StaleEpoch(f"epoch {checkpoint.epoch} is older than {entry.epoch} (CK2)")
    if checkpoint.epoch > entry.epoch:
        # Newer than assigned, not stale: only the PC raises an epoch (CK5).
        raise Conflict(f"epoch {checkpoint.epoch} was never assigned (current {entry.epoch})")
    if instance != entry.owner:
        # SEC5: an instance fenced off by a newer epoch cannot extend the session.
        raise Forbidden("the session belongs to another instance")
    best = entry.checkpoint
    if (
        best is not None
        and best.epoch == checkpoint.epoch
        and checkpoint.output_offset < best.output_offset
    ):
        return dataclasses.replace(entry, touched=now, owner_epoch=owner_epoch)  # the higher stays
    return dataclasses.replace(entry, checkpoint=checkpoint, touched=now, owner_epoch=owner_epoch)


def check_end(entry: SessionEntry | None, instance: str) -> SessionEntry:
    """Only the session's current owner ends it (SEC5)."""
    if entry is None:
        raise NotFound("unknown session")
    if entry.owner != instance:
        raise Forbidden("the session belongs to another instance")
    return entry


@dataclass(frozen=True, slots=True)
class MapEntry:
    """A shard map the PC holds (RS1), and the reshard in progress, if any."""

    current: ShardMap
    #: The version being resharded to, until ``pending_until`` (a PC that
    #: died mid-reshard does not block the map for longer).
    pending: int | None = None
    pending_until: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "map": self.current.to_json(),
            "pending": self.pending,
            "pending_until": self.pending_until,
        }

    @classmethod
    def from_json(cls, value: Any) -> MapEntry:
        return cls(
            ShardMap.from_json(value["map"]), value["pending"], float(value["pending_until"])
        )


def after_map_created(entry: MapEntry | None, shard_map: ShardMap) -> MapEntry:
    if entry is not None and entry.current != shard_map:
        raise PlanConflict(f"map {shard_map.map} exists at version {entry.current.version}")
    return entry or MapEntry(shard_map)


def after_reshard_started(
    entry: MapEntry | None, target: ShardMap, now: float, hold_s: float
) -> MapEntry:
    """RS5: version v stays authoritative; one reshard of a map at a time."""
    if entry is None:
        raise UnknownResource(f"unknown map {target.map}")
    if entry.pending is not None and entry.pending_until > now:
        raise PlanConflict(f"map {target.map} is being resharded to {entry.pending}")
    if target.version != entry.current.version + 1:
        raise PlanConflict(
            f"map {target.map} is at version {entry.current.version}; cannot go to {target.version}"
        )
    return MapEntry(entry.current, target.version, now + hold_s)


def after_reshard_ended(entry: MapEntry | None, target: ShardMap, committed: bool) -> MapEntry:
    """RS5: the commit makes v+1 current; RS6: an abort keeps v."""
    if entry is None or entry.pending != target.version:
        raise PlanConflict(f"map {target.map} has no reshard to {target.version} in progress")
    return MapEntry(target if committed else entry.current)
