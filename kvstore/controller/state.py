"""What the Placement Controller knows: instances, their epochs, sessions.

Rules, with the requirement each serves:

* a status record with a lower epoch than the highest seen for its instance
  is discarded with ``kvsp-stale-epoch`` (S2);
* an instance whose record expired (``ttl_ms`` after it arrived) is failed
  (S1); no request or directive goes to a non-active instance (S4);
* ``requested_state: "sleeping"`` is answered ``draining`` when the
  instance has been idle (running and queued below thresholds) for the
  configured time, else ``active`` (S3); a sleeping instance stays asleep
  until the PC changes its state (S6);
* a checkpoint keeps the highest ``output_offset`` of the session's current
  epoch; a lower epoch is ``kvsp-stale-epoch``; only the session's current
  owner may checkpoint it (CK2, CK7, SEC5).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..protocol.control import InstanceStatus, SessionCheckpoint
from ..protocol.problems import (
    BadRequest,
    Forbidden,
    InsufficientStorage,
    InvalidState,
    NotFound,
    StaleEpoch,
)


@dataclass(frozen=True, slots=True)
class SleepPolicy:
    """When an instance asking to sleep may (S3)."""

    max_running: int = 0
    max_queued: int = 0
    idle_for_s: float = 60.0


@dataclass(slots=True)
class InstanceEntry:
    status: InstanceStatus
    expires_at: float
    highest_epoch: int
    #: The lifecycle state the PC holds for the instance (it wins over the
    #: reported one while a transition is in progress).
    state: str
    idle_since: float | None = None


@dataclass(slots=True)
class SessionEntry:
    session: str
    epoch: int
    owner: str
    checkpoint: SessionCheckpoint | None = None


@dataclass(slots=True)
class ControllerState:
    """In-memory controller state for one process."""

    sleep_policy: SleepPolicy = field(default_factory=SleepPolicy)
    clock: Callable[[], float] = time.monotonic
    #: Bounds on what instances can make the PC remember (hostile input).
    max_sessions: int = 100_000
    max_sessions_per_owner: int = 10_000
    _per_owner: dict[str, int] = field(default_factory=dict)
    instances: dict[str, InstanceEntry] = field(default_factory=dict)
    sessions: dict[str, SessionEntry] = field(default_factory=dict)

    # --- status and lifecycle ---------------------------------------------

    def put_status(self, status: InstanceStatus) -> str:
        """Record a status report; returns the state to answer with (S2, S3)."""
        now = self.clock()
        entry = self.instances.get(status.instance)
        if entry is not None and status.epoch < entry.highest_epoch:
            raise StaleEpoch(
                f"epoch {status.epoch} is older than {entry.highest_epoch} for this instance"
            )
        restarted = entry is None or status.epoch > entry.highest_epoch
        state = status.state if restarted or entry is None else entry.state
        if restarted and entry is not None and entry.state in ("draining", "sleeping"):
            # S6: a restart does not wake an instance the PC put to sleep (a
            # draining one comes back with no sessions: it is asleep).
            state = "sleeping"
        if entry is not None and not restarted and entry.state == "sleeping":
            state = "sleeping"  # S6: only the PC wakes it
        if entry is not None and not restarted and entry.state == "draining":
            # S5: a draining instance reports sleeping once it has no sessions.
            state = "sleeping" if status.state == "sleeping" else "draining"
        idle = status.running <= self.sleep_policy.max_running and (
            status.queued <= self.sleep_policy.max_queued
        )
        idle_since = None
        if idle:
            previous = entry.idle_since if entry is not None and not restarted else None
            idle_since = previous if previous is not None else now
        if status.requested_state == "sleeping" and state == "active":
            long_enough = (
                idle_since is not None and now - idle_since >= self.sleep_policy.idle_for_s
            )
            state = "draining" if long_enough else "active"
        self.instances[status.instance] = InstanceEntry(
            status=status,
            expires_at=now + status.ttl_ms / 1000,
            highest_epoch=status.epoch,
            state=state,
            idle_since=idle_since,
        )
        return state

    def state_of(self, instance: str) -> str:
        """The instance's lifecycle state; ``failed`` once its record expired (S1)."""
        entry = self.instances.get(instance)
        if entry is None:
            raise NotFound("unknown instance")
        if entry.expires_at <= self.clock():
            return "failed"
        return entry.state

    def set_state(self, instance: str, state: str) -> None:
        """The PC's own decision (what it sends with ``PUT state``, S3/S6)."""
        entry = self.instances.get(instance)
        if entry is None:
            raise NotFound("unknown instance")
        entry.state = state

    def active(self) -> list[InstanceStatus]:
        """Instances that may receive requests and directives (S4)."""
        now = self.clock()
        return [
            e.status for e in self.instances.values() if e.state == "active" and e.expires_at > now
        ]

    def failed(self) -> list[str]:
        now = self.clock()
        return [name for name, e in self.instances.items() if e.expires_at <= now]

    def require_active(self, instance: str) -> None:
        if self.state_of(instance) != "active":
            raise InvalidState(f"instance is {self.state_of(instance)}, not active (S4)")

    async def status(self, instance: str) -> InstanceStatus | None:
        """StatusSource for the Index Service's estimates: active instances only."""
        entry = self.instances.get(instance)
        if entry is None or entry.state != "active" or entry.expires_at <= self.clock():
            return None
        return entry.status

    # --- sessions and checkpoints -------------------------------------------

    def assign(self, session: str, owner: str, epoch: int = 1) -> SessionEntry:
        """A session starts (or resumes, with a higher epoch) on ``owner``."""
        entry = self.sessions.get(session)
        if entry is not None and epoch <= entry.epoch:
            raise StaleEpoch(f"session is at epoch {entry.epoch}")
        if entry is None and len(self.sessions) >= self.max_sessions:
            raise InsufficientStorage(f"the PC tracks its maximum of {self.max_sessions} sessions")
        if (entry is None or entry.owner != owner) and (
            self._per_owner.get(owner, 0) >= self.max_sessions_per_owner
        ):
            raise InsufficientStorage("this instance has its maximum of open sessions")
        if entry is not None:
            self._per_owner[entry.owner] -= 1
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        checkpoint = entry.checkpoint if entry is not None else None
        self.sessions[session] = SessionEntry(session, epoch, owner, checkpoint)
        return self.sessions[session]

    def put_checkpoint(self, checkpoint: SessionCheckpoint, instance: str) -> SessionEntry:
        """CK2, CK7: keep the highest output_offset of the current epoch."""
        entry = self.sessions.get(checkpoint.session)
        if entry is None:
            # A session the PC has not placed: its first checkpoint registers
            # it, at epoch 1 only (a later epoch is the PC's to hand out).
            if checkpoint.epoch != 1:
                raise StaleEpoch(f"epoch {checkpoint.epoch} was never assigned")
            entry = self.assign(checkpoint.session, instance, 1)
        elif entry.checkpoint is not None and (
            (checkpoint.scope_id, checkpoint.compat_id)
            != (entry.checkpoint.scope_id, entry.checkpoint.compat_id)
        ):
            raise BadRequest("a session keeps its scope and compatibility")
        if checkpoint.epoch < entry.epoch:
            raise StaleEpoch(f"epoch {checkpoint.epoch} is older than {entry.epoch} (CK2)")
        if checkpoint.epoch > entry.epoch:
            raise StaleEpoch(f"epoch {checkpoint.epoch} was never assigned (current {entry.epoch})")
        if instance != entry.owner:
            # SEC5: an instance fenced off by a newer epoch cannot extend the session.
            raise Forbidden("the session belongs to another instance")
        best = entry.checkpoint
        if (
            best is None
            or best.epoch < checkpoint.epoch
            or (checkpoint.output_offset >= best.output_offset)
        ):
            entry.checkpoint = checkpoint
        return entry

    def sessions_of(self, instance: str) -> list[SessionEntry]:
        return [s for s in self.sessions.values() if s.owner == instance]
