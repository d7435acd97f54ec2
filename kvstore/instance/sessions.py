"""Sessions: generation on the instance's engine, with checkpoints and resume.

A session starts from a prompt (our ``POST generate``) or from the PC's
``POST sessions/{session}/resume`` (CK5). Either way the instance makes the
longest prefix of the sequence's blocks resident (held already, prefetched
by a directive sent ahead of the request, or fetched through the IS), feeds
their KV to the engine and recomputes only the rest (CK6). While it decodes:

- every completed block, of the prompt or of the output, becomes a block
  container placed in the instance's tiers (published by its holder role)
  and written to the configured holders, so that it survives the instance
  (CK1);
- a checkpoint goes to the PC at each completed output block and at least
  every ``checkpoint_tokens`` (at most 64) tokens (CK1), the first one right
  after the prefill so that the PC knows the session at once;
- each output token carries its index and the session's epoch (CK4). A
  token is released only after the PC acknowledged a checkpoint covering
  it, ``release_tokens`` at a time (CK3). Only where the operator claims
  greedy decoding deterministic (``greedy_deterministic``) is a greedy token
  released at once; a resumed instance then regenerates the same tokens,
  which the front end drops by index (CK3).
- a checkpoint the PC refuses for its epoch (409 ``kvsp-stale-epoch``) or
  owner (403) means the session was moved: it stops here (CK7).

Engine calls run one at a time on a worker thread, so prefetch directives,
status reports and token streams go on while the model computes (PF1).

Checkpoints list as ``prompt_blocks`` the complete blocks before the
prompt's last token and the rest of the prompt as ``prompt_tail``: a
resuming instance has only the checkpoint's tokens, and it needs the
prompt's last token itself (for the logits after it) when no output was
checkpointed yet. For a prompt whose length is not a multiple of the block
size this is exactly the draft's definition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from ..protocol.control import GenerationLimits, ResumeRequest, Sampler
from ..protocol.keys import BlockKeyChain
from ..protocol.lifecycle import InstanceState
from ..protocol.problems import (
    BadRequest,
    Forbidden,
    Incompatible,
    InvalidState,
    KvspError,
    NotFound,
    PreconditionFailed,
    StaleEpoch,
)
from ..seams import Controller, Holders
from ..settings import InstanceSettings
from ..storage import BlockRef, TieredStore
from .engine import Engine, Generation, block_container, load_blocks, sample
from .lifecycle import Lifecycle
from .prefetch import Prefetcher
from .reporter import Load
from .requests import GenerateRequest, check_sampler
from .runtime import BlockWriter, EngineRunner
from .session import PLACEHOLDER, Session, SessionCounters, TooManySessions
from .session_state import SessionEvent

__all__ = ["PLACEHOLDER", "Session", "SessionCounters", "Sessions", "TooManySessions"]

log = logging.getLogger("kvstore.instance")


class Sessions:
    """The instance's sessions over one engine."""

    def __init__(
        self,
        settings: InstanceSettings,
        engine: Engine,
        store: TieredStore,
        scope_keys: Mapping[str, bytes],
        lifecycle: Lifecycle,
        load: Load,
        *,
        prefetcher: Prefetcher,
        controller: Controller | None = None,
        holders: Holders | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``controller``: a :class:`~kvstore.client.ControllerClient` for
        checkpoints (None: a standalone instance; tokens are released at once
        and sessions cannot be resumed elsewhere)."""
        if not 1 <= settings.checkpoint_tokens <= 64:
            raise ValueError("checkpoint_tokens: 1 to 64 (CK1)")
        self.settings, self.engine, self.store = settings, engine, store
        self.scope_keys, self.lifecycle, self.load = dict(scope_keys), lifecycle, load
        self.prefetcher, self.controller = prefetcher, controller
        self.clock = clock
        self.runner = EngineRunner(engine)
        self.writer = BlockWriter(holders, settings.store_blocks_to if holders is not None else ())
        self.descriptor = engine.descriptor
        self.compat_id = self.descriptor.compat_id_hex
        self.block_tokens = self.descriptor.block_tokens
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self._admit = asyncio.Semaphore(settings.max_running)
        self._background: set[asyncio.Task[None]] = set()
        self._calibration: asyncio.Task[None] | None = None
        #: Sessions being restored by a resume (not yet in ``sessions``).
        self._resuming: set[str] = set()
        self.counters = SessionCounters()

    # --- rates ----------------------------------------------------------------

    def start(self) -> None:
        """Measure the engine's prefill and decode rates once (in the
        background), so that the first status reports real numbers (R3) and
        the PC can estimate recompute times before any session ran."""
        self._calibration = asyncio.create_task(self.calibrate(), name="kvstore-calibrate")

    async def calibrate(self, tokens: int = 128, steps: int = 8) -> None:
        def measure() -> tuple[float, float]:
            prompt = [(7 * i + 3) % 256 for i in range(tokens)]
            started = time.perf_counter()
            run = self.engine.prefill(prompt)
            prefilled = time.perf_counter()
            for i in range(steps):
                self.engine.extend(run, (11 * i + 5) % 256)
            done = time.perf_counter()
            return tokens / max(prefilled - started, 1e-6), steps / max(done - prefilled, 1e-6)

        try:
            prefill, decode = await self.runner.call(measure)
        except Exception:
            log.exception("measuring the engine's rates failed")
            return
        self.load.prefill_tokens_per_s, self.load.decode_tokens_per_s = prefill, decode
        log.info("engine: %.0f prefill and %.0f decode tokens/s", prefill, decode)

    # --- admission ----------------------------------------------------------

    def _open(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.finished) + len(self._resuming)

    def _check_admission(self, scope_id: str, compat_id: str) -> bytes:
        if self.lifecycle.state is not InstanceState.ACTIVE:
            raise InvalidState(f"the instance is {self.lifecycle.state} (S4, S5)")
        if compat_id != self.compat_id:
            raise Incompatible("the session's compat_id is not this engine's (C3)")
        key = self.scope_keys.get(scope_id)
        if key is None:
            raise Forbidden("this instance does not hold the scope's key")
        if self._open() >= self.settings.max_sessions:
            raise TooManySessions(f"{self.settings.max_sessions} sessions are open")
        return key

    def _keep(self, session: Session) -> None:
        self.sessions[session.id] = session
        while len(self.sessions) > self.settings.max_sessions + self.settings.keep_finished:
            done = next((k for k, s in self.sessions.items() if s.finished), None)
            if done is None:
                break
            del self.sessions[done]

    def _update_load(self) -> None:
        open_ = self._open()
        self.load.running = min(open_, self.settings.max_running)
        self.load.queued = max(0, open_ - self.settings.max_running)
        self.load.links = self.prefetcher.links()

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound("unknown session")
        return session

    # --- starting -----------------------------------------------------------

    def begin(self, request: GenerateRequest) -> Session:
        """A new session (our ``POST generate``); it runs in the background."""
        scope_key = self._check_admission(request.scope_id, self.compat_id)
        known = self.sessions.get(request.session)
        if known is not None:
            raise InvalidState("the session exists already")
        sampler = request.sampler
        if sampler.method == "greedy" and not self.settings.greedy_deterministic:
            sampler = Sampler("greedy", sampler.seed, 0, False, dict(sampler.params))
        chain = BlockKeyChain(scope_key, bytes.fromhex(self.compat_id), self.block_tokens)
        prompt = list(request.tokens)
        session = Session(
            id=request.session,
            scope_id=request.scope_id,
            compat_id=self.compat_id,
            epoch=1,
            sampler=sampler,
            limits=GenerationLimits(request.max_tokens, request.stop_tokens),
            tokens=prompt,
            prompt_tokens=len(prompt),
            block_tokens=self.block_tokens,
            prompt_blocks=(len(prompt) - 1) // self.block_tokens,
            chain=chain,
            keys=[k.hex() for k in chain.extend(prompt)],
        )
        session.stats.update(
            prompt_tokens=len(prompt), logprobs=request.logprobs, requested=self.clock()
        )
        self._keep(session)
        self.counters.sessions += 1
        self._update_load()
        session.task = asyncio.create_task(
            self._run(session, request.request_ref), name=f"session-{session.id}"
        )
        return session

    async def resume(self, request: ResumeRequest, session_id: str) -> Session:
        """CK5, CK6: take over a session from its checkpoint at a new epoch.
        Returns once the sequence is restored (its blocks loaded, the rest
        recomputed): an error leaves the PC free to try another instance."""
        checkpoint = request.checkpoint
        if checkpoint.session != session_id:
            raise BadRequest("the checkpoint's session is not the path's session")
        scope_key = self._check_admission(checkpoint.scope_id, checkpoint.compat_id)
        sampler = checkpoint.sampler
        params = check_sampler(sampler.method, sampler.params, "checkpoint.sampler")
        if sampler.step != checkpoint.output_offset:
            raise BadRequest("checkpoint.sampler.step: must be the output_offset")
        if checkpoint.output_offset != len(checkpoint.generated):
            raise BadRequest("the checkpoint must list every output token (output_offset)")
        known = self.sessions.get(session_id)
        if known is not None and known.epoch >= request.epoch:
            raise StaleEpoch(f"the session is at epoch {known.epoch} here (CK7)")
        if session_id in self._resuming:
            raise InvalidState("a resume of this session is in progress here")
        limits = checkpoint.limits or GenerationLimits(self.settings.max_output_tokens)
        limits = GenerationLimits(
            min(limits.max_tokens, self.settings.max_output_tokens), limits.stop_tokens
        )
        size = self.block_tokens
        last = bytes.fromhex(checkpoint.prompt_blocks[-1]) if checkpoint.prompt_blocks else None
        chain = BlockKeyChain(
            scope_key, bytes.fromhex(self.compat_id), size, *([last] if last is not None else [])
        )
        known_tokens = [*checkpoint.prompt_tail, *checkpoint.generated]
        if not known_tokens:
            # The logits after the prompt need its last token, which the
            # checkpoint has only inside a block's key.
            raise BadRequest("the checkpoint has no token after its prompt blocks")
        keys = [*checkpoint.prompt_blocks, *(k.hex() for k in chain.extend(known_tokens))]
        prompt_blocks = len(checkpoint.prompt_blocks)
        tokens = [PLACEHOLDER] * (prompt_blocks * size) + known_tokens
        session = Session(
            id=session_id,
            scope_id=checkpoint.scope_id,
            compat_id=self.compat_id,
            epoch=request.epoch,
            sampler=Sampler(
                sampler.method, sampler.seed, sampler.step, sampler.deterministic, params
            ),
            limits=limits,
            tokens=tokens,
            prompt_tokens=prompt_blocks * size + len(checkpoint.prompt_tail),
            block_tokens=size,
            prompt_blocks=prompt_blocks,
            generated=list(checkpoint.generated),
            logprobs=[None] * checkpoint.output_offset,
            chain=chain,
            keys=keys,
        )
        session.stats.update(
            prompt_tokens=session.prompt_tokens,
            requested=self.clock(),
            resumed_from=checkpoint.output_offset,
        )
        # The tokens the checkpoint covers were delivered or may be again (CK3).
        session.released = session.checkpointed = checkpoint.output_offset
        generated = checkpoint.generated
        if len(generated) >= limits.max_tokens or (
            generated and generated[-1] in limits.stop_tokens
        ):
            # It had ended; the end did not reach the PC. Nothing to compute.
            self._install(session, known, request.epoch)
            await self._finish(session)
            return session
        self._resuming.add(session_id)
        try:
            async with asyncio.timeout(self.settings.resume_deadline_ms / 1000):
                loaded = await self._restore(session, minimum=prompt_blocks)
        finally:
            self._resuming.discard(session_id)
        known = self.sessions.get(session_id)
        if known is not None and known.epoch >= request.epoch:
            self._release(session)
            raise StaleEpoch(f"the session is at epoch {known.epoch} here (CK7)")
        self._install(session, known, request.epoch)
        session.task = asyncio.create_task(
            self._decode(session, loaded), name=f"session-{session.id}"
        )
        return session

    def _install(self, session: Session, known: Session | None, epoch: int) -> None:
        if known is not None and not known.finished:
            self._fence(known, f"resumed here at epoch {epoch}")
        self._keep(session)
        self.counters.resumed += 1
        self._update_load()

    # --- running ------------------------------------------------------------

    async def _restore(self, session: Session, minimum: int = 0) -> int:
        """Load the longest resident prefix of the session's blocks, prefill
        the rest; returns the number of blocks loaded."""
        wanted = session.keys
        deadline_s = self.settings.load_deadline_ms / 1000
        held = await self.prefetcher.load(
            session.scope_id, session.compat_id, wanted, deadline_s=deadline_s
        )
        if held < minimum:
            raise InvalidState(
                f"only {held} of the {minimum} prompt blocks the checkpoint names could be loaded"
            )
        containers: list[bytes] = []
        for key in wanted[:held]:
            try:
                containers.append(
                    await self.store.get(BlockRef(session.compat_id, session.scope_id, key))
                )
            except NotFound:
                break  # evicted meanwhile: the rest is recomputed
        if len(containers) < minimum:
            raise InvalidState("prompt blocks were evicted while being loaded")
        loaded = len(containers)
        kv = (
            await self.runner.call(load_blocks, containers, self.descriptor) if containers else None
        )
        started = self.clock()
        session.generation = generation = await self.runner.call(
            self.engine.prefill, session.tokens, kv
        )
        elapsed = max(self.clock() - started, 1e-6)
        loaded_tokens = len(session.tokens) - generation.computed
        session.stats.update(
            loaded_tokens=loaded_tokens, computed_tokens=generation.computed, loaded_blocks=loaded
        )
        self.counters.loaded_tokens += loaded_tokens
        self.counters.computed_tokens += generation.computed
        self._rate("prefill_tokens_per_s", generation.computed / elapsed)
        return loaded

    def _rate(self, name: str, value: float) -> None:
        old = getattr(self.load, name)
        setattr(self.load, name, value if old <= 0 else old + 0.2 * (value - old))

    async def _run(self, session: Session, request_ref: str | None) -> None:
        try:
            async with self._admit:
                if request_ref is not None:
                    # The PC sent a directive ahead of this request (PL2):
                    # its blocks are the prefix to load.
                    deadline_s = self.settings.load_deadline_ms / 1000
                    await self.prefetcher.settled(request_ref, deadline_s)
                loaded = await self._restore(session)
                await self._decode(session, loaded, admitted=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(session, exc)

    async def _decode(self, session: Session, loaded: int, admitted: bool = False) -> None:
        if not admitted:
            try:
                async with self._admit:
                    await self._decode(session, loaded, admitted=True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._fail(session, exc)
            return
        generation = session.generation
        assert generation is not None
        # The checkpoint names the prompt blocks: they are in place, and on
        # the holders they are written to, before it goes (CK1, CK6).
        await self._store_blocks(session, loaded, durable=True)
        stored = len(session.tokens) // self.block_tokens
        if not await self._checkpoint(session):  # the PC knows the session at once
            return
        deterministic = session.sampler.deterministic or self.controller is None
        every = self.settings.checkpoint_tokens if deterministic else self.settings.release_tokens
        since = 0
        limits = session.limits
        while len(session.generated) < limits.max_tokens and not session.finished:
            step = len(session.generated)
            token, logprob = await self.runner.call(self._sample, session, generation, step)
            session.generated.append(token)
            session.logprobs.append(logprob)
            if session.stats.get("first_token_s") is None:
                session.stats["first_token_s"] = self.clock()
            if deterministic:
                session.released = len(session.generated)
                session.changed()
            self.counters.output_tokens += 1
            since += 1
            last = token in limits.stop_tokens or len(session.generated) >= limits.max_tokens
            if not last:
                started = self.clock()
                await self.runner.call(self.engine.extend, generation, token)
                self._rate("decode_tokens_per_s", 1 / max(self.clock() - started, 1e-6))
                session.keys.extend(k.hex() for k in session.chain.extend([token]))  # type: ignore[union-attr]
                if len(generation.tokens) // self.block_tokens > stored:
                    await self._store_blocks(session, stored)  # CK1: a completed output block
                    stored = len(generation.tokens) // self.block_tokens
                    since = every
            if since >= every or last:
                since = 0
                if not await self._checkpoint(session):
                    return
            lagging = last or len(session.generated) - session.released >= 64
            # CK3: no token out before an acknowledged checkpoint covers it;
            # while the PC does not answer, the session waits for it.
            if not deterministic and lagging and not await self._acknowledged(session):
                return
            if self.settings.token_interval_ms and not last:
                await asyncio.sleep(self.settings.token_interval_ms / 1000)
            if last:
                break
        if session.finished:
            return
        await self._finish(session)

    async def _finish(self, session: Session) -> None:
        session.released = len(session.generated)
        session.apply(SessionEvent.FINISHED)
        self._finish_stats(session)
        self._release(session)
        session.changed()
        self._update_load()
        await self._end_at_pc(session)

    async def _end_at_pc(self, session: Session) -> None:
        """The session is over: the PC forgets it (it is never resumed)."""
        if self.controller is None:
            return
        for attempt in range(3):
            try:
                await self.controller.end_session(session.id)
                return
            except (StaleEpoch, Forbidden):
                return  # moved on, or ended already
            except KvspError as exc:
                log.warning("ending %s at the PC: %s", session.id, exc.detail)
                await asyncio.sleep(0.2 * (attempt + 1))

    def _release(self, session: Session) -> None:
        """A finished session's engine state goes (a real engine's KV memory)."""
        session.generation = None
        session.chain = None

    @staticmethod
    def _sample(session: Session, generation: Generation, step: int) -> tuple[int, float | None]:
        token = sample(generation.logits, session.sampler, step)
        if not session.stats.get("logprobs"):
            return token, None
        import torch

        logprob = torch.log_softmax(generation.logits.double(), dim=-1)[token].item()
        return token, float(logprob)

    def _finish_stats(self, session: Session) -> None:
        requested = session.stats.pop("requested", None)
        first = session.stats.pop("first_token_s", None)
        if requested is not None and first is not None:
            session.stats["ttft_ms"] = round((first - requested) * 1000, 3)
        session.stats.pop("logprobs", None)

    async def _store_blocks(self, session: Session, start: int, durable: bool = False) -> None:
        """Blocks ``start..`` of the sequence that are complete: into the
        tiers (published as the instance's replicas) and to the holders
        (``durable``: awaited, else queued)."""
        generation = session.generation
        assert generation is not None
        end = min(len(generation.tokens) // self.block_tokens, len(session.keys))
        for index in range(start, end):
            ref = BlockRef(session.compat_id, session.scope_id, session.keys[index])
            body = bytes(await self.runner.call(block_container, self.engine, generation, index))
            await self._place(ref, body)
            if durable:
                await self.writer.write_now(ref, body)
            else:
                self.writer.write(ref, body)

    async def _place(self, ref: BlockRef, body: bytes) -> None:
        try:
            await self.store.put(ref, body)
        except PreconditionFailed:
            return
        except KvspError as exc:
            log.warning("block %s not placed: %s", ref.block_key[:12], exc.detail)

    async def _checkpoint(self, session: Session) -> bool:
        """CK1, CK3: checkpoint at the PC; False when the session must stop here."""
        if self.controller is None:
            return True
        checkpoint = session.checkpoint()
        for attempt in range(3):
            try:
                acked = await self.controller.put_checkpoint(checkpoint)
            except StaleEpoch as exc:
                # CK7: a newer epoch owns the session now; nothing more here.
                self._fence(session, exc.detail)
                return False
            except (Forbidden, BadRequest, NotFound) as exc:
                # The PC will not take this session's checkpoints at all.
                self._fail(session, KvspError(f"the PC refused the checkpoint: {exc.detail}"))
                return False
            except KvspError as exc:
                self.counters.checkpoint_failures += 1
                log.warning("checkpoint of %s failed: %s", session.id, exc.detail)
                await asyncio.sleep(0.1 * (attempt + 1))
                continue
            self.counters.checkpoints += 1
            if acked > checkpoint.output_offset:
                # The PC holds more output for this session and epoch than
                # this run produced: its id names another run (a reused id).
                self._fail(session, KvspError("the PC holds another run under this session id"))
                return False
            session.checkpointed = max(session.checkpointed, acked)
            if not session.sampler.deterministic and session.checkpointed > session.released:
                session.released = min(session.checkpointed, len(session.generated))
                session.changed()
            return True
        return True  # the PC is unreachable: go on; held tokens wait for an ack

    async def _acknowledged(self, session: Session, patience_s: float = 60.0) -> bool:
        deadline = self.clock() + patience_s
        while session.checkpointed < len(session.generated):
            if session.finished:
                return False
            if self.clock() > deadline:
                self._fail(session, KvspError("the PC acknowledged no checkpoint in time (CK3)"))
                return False
            await asyncio.sleep(0.5)
            if not await self._checkpoint(session):
                return False
        return True

    def _fence(self, session: Session, detail: str) -> None:
        if session.finished:
            return  # a session ends once: a late fence of an ended one is dropped
        session.apply(SessionEvent.FENCED, detail)  # CK7
        self._release(session)
        self.counters.moved += 1
        log.warning("session %s stops here: %s", session.id, detail)
        if session.task is not None and session.task is not asyncio.current_task():
            session.task.cancel()
        session.changed()
        self._update_load()

    def _fail(self, session: Session, exc: Exception) -> None:
        if session.finished:
            return  # a session ends once (CK7: one fenced meanwhile stays moved)
        detail = exc.detail if isinstance(exc, KvspError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, KvspError):
            log.error("session %s failed", session.id, exc_info=exc)
        session.apply(SessionEvent.FAILED, detail)
        self._release(session)
        self.counters.failed += 1
        session.changed()
        self._update_load()
        if self.controller is not None:
            # Not to be resumed elsewhere: its client was told it failed.
            task = asyncio.create_task(self._end_at_pc(session), name=f"end-{session.id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # --- following ----------------------------------------------------------

    async def follow(self, session: Session, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The session's events from output index ``start``: its head, each
        released token (index, epoch, CK4), then how it ended."""
        yield session.head()
        index = start
        while True:
            changed = session._changed
            while index < session.released:
                yield session.event(index)
                index += 1
            if session.finished and index >= session.released:
                yield session.end()
                return
            await changed.wait()

    async def stop(self) -> None:
        """With the instance's lifespan (see :meth:`close`)."""
        await self.close()

    async def close(self) -> None:
        tasks = [s.task for s in list(self.sessions.values()) if s.task is not None]
        tasks += [*self._background, *([self._calibration] if self._calibration else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.writer.close()
        self.runner.close()
