"""Sessions on the reference engine: prefix reuse, checkpoints (CK1-CK4),
fencing (CK7) and resume (CK5, CK6), with the PC's own rules behind the
checkpoints (:class:`MemoryControllerState`) and no network."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import uuid
from typing import Any

import pytest

from kvstore.backends.host import HostTier
from kvstore.controller.state import MemoryControllerState
from kvstore.instance.engine import sample
from kvstore.instance.lifecycle import Lifecycle
from kvstore.instance.prefetch import Prefetcher
from kvstore.instance.reference import EOS, ReferenceEngine, encode_text
from kvstore.instance.reporter import Load
from kvstore.instance.requests import GenerateRequest
from kvstore.instance.sessions import Session, Sessions
from kvstore.protocol.control import ResumeRequest, Sampler, SessionCheckpoint
from kvstore.protocol.keys import block_keys, scope_id
from kvstore.protocol.problems import (
    BadRequest,
    Forbidden,
    Incompatible,
    InvalidState,
    StaleEpoch,
)
from kvstore.settings import InstanceSettings
from kvstore.storage import BlockRef, TieredStore

SCOPE_KEY = bytes(range(32))
SCOPE = scope_id(SCOPE_KEY).hex()
A, B = "https://a.test/ii/", "https://b.test/ii/"
PROMPT = encode_text("Blocks of a shared prefix are loaded, not recomputed: ")
GREEDY = Sampler("greedy", 0, 0, True)
TOP_P = Sampler("top-p", 7, 0, False, {"p": 0.9, "temperature": 1.0})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ReferenceEngine:
    return ReferenceEngine(tmp_path_factory.mktemp("ref"), block_tokens=8)


def uninterrupted(
    engine: ReferenceEngine, prompt: list[int], n: int, sampler: Sampler
) -> list[int]:
    run = engine.prefill(prompt)
    out = []
    for step in range(n):
        out.append(sample(run.logits, sampler, step))
        engine.extend(run, out[-1])
    return out


class Controller:
    """The PC's checkpoint rules (CK2, CK7) without HTTP, recording each ack."""

    def __init__(self, instance: str, state: MemoryControllerState | None = None) -> None:
        self.instance = instance
        self.state = state or MemoryControllerState()
        self.acks: list[tuple[int, int]] = []  # (epoch, output_offset) acknowledged
        self.checkpoints: list[SessionCheckpoint] = []
        self.ended: list[str] = []
        self.delay_s = 0.0

    async def put_checkpoint(self, checkpoint: SessionCheckpoint) -> int:
        await asyncio.sleep(self.delay_s)
        entry = await self.state.put_checkpoint(checkpoint, self.instance)
        self.checkpoints.append(checkpoint)
        assert entry.checkpoint is not None
        self.acks.append((entry.epoch, entry.checkpoint.output_offset))
        return entry.checkpoint.output_offset

    async def end_session(self, session: str) -> None:
        self.ended.append(session)
        await self.state.end_session(session, self.instance)


def make(
    engine: ReferenceEngine,
    instance: str = A,
    controller: Any = None,
    store: TieredStore | None = None,
    **settings: Any,
) -> Sessions:
    store = TieredStore([(HostTier(), 64 << 20)]) if store is None else store
    return Sessions(
        InstanceSettings(instance, **settings),
        engine,
        store,
        {SCOPE: SCOPE_KEY},
        Lifecycle(),
        Load(),
        prefetcher=Prefetcher(store, None),
        controller=controller,
    )


def request(prompt: list[int], n: int, sampler: Sampler = GREEDY, **kw: Any) -> GenerateRequest:
    return GenerateRequest(str(uuid.uuid4()), SCOPE, tuple(prompt), n, sampler, **kw)


async def output(sessions: Sessions, session: Session, start: int = 0) -> list[dict[str, Any]]:
    async with asyncio.timeout(60):
        return [e async for e in sessions.follow(session, start)]


def tokens(events: list[dict[str, Any]]) -> list[int]:
    return [e["token"] for e in events if "index" in e]


async def test_greedy_output_is_the_engine_s_and_blocks_are_placed(
    engine: ReferenceEngine,
) -> None:
    sessions = make(engine)
    session = sessions.begin(request(PROMPT, 20))
    events = await output(sessions, session)
    assert tokens(events) == uninterrupted(engine, PROMPT, 20, GREEDY)
    assert [e["index"] for e in events if "index" in e] == list(range(20))
    assert events[0]["event"] == "session" and events[-1]["event"] == "done"
    # Every complete block of the fed sequence (the last token is not fed).
    fed = PROMPT + tokens(events)[:-1]
    keys = block_keys(SCOPE_KEY, bytes.fromhex(sessions.compat_id), fed, 8)
    await asyncio.sleep(0.05)
    held = {
        r.block_key
        for r in (BlockRef(sessions.compat_id, SCOPE, k.hex()) for k in keys)
        if r in sessions.store
    }
    assert held == {k.hex() for k in keys} and len(keys) == len(fed) // 8
    await sessions.close()


async def test_a_shared_prefix_is_loaded_and_gives_the_same_output(
    engine: ReferenceEngine,
) -> None:
    sessions = make(engine)
    first = sessions.begin(request(PROMPT, 4))
    await output(sessions, first)
    await asyncio.sleep(0.05)  # placing the blocks
    other = PROMPT[:40] + encode_text("another question?")[1:]
    second = sessions.begin(request(other, 12, logprobs=True))
    events = await output(sessions, second)
    stats = events[-1]["stats"]
    assert stats["loaded_tokens"] == 40 and stats["computed_tokens"] == len(other) - 40
    assert tokens(events) == uninterrupted(engine, other, 12, GREEDY)
    # Logits with the loaded prefix match a full recompute within 1e-4 (fp32).
    import torch

    run = engine.prefill(other)
    for event in events[1:-1]:
        expected = torch.log_softmax(run.logits.double(), dim=-1)[event["token"]].item()
        assert abs(event["logprob"] - expected) < 1e-4
        engine.extend(run, event["token"])
    await sessions.close()


async def test_checkpoints_at_start_at_each_output_block_and_at_the_end(
    engine: ReferenceEngine,
) -> None:
    pc = Controller(A)
    sessions = make(engine, controller=pc, checkpoint_tokens=5)
    session = sessions.begin(request(PROMPT, 30))
    await output(sessions, session)
    offsets = [c.output_offset for c in pc.checkpoints]
    assert offsets[0] == 0 and offsets[-1] == 30 and offsets == sorted(offsets)
    assert all(b - a <= 5 for a, b in itertools.pairwise(offsets))  # CK1
    # A checkpoint as each output block completes: the sequence reaches a
    # multiple of 8 tokens when output token (8k - len(PROMPT)) is fed.
    completes = {n for n in range(1, 30) if (len(PROMPT) + n) % 8 == 0}
    assert completes <= set(offsets)
    last = pc.checkpoints[-1]
    assert last.generated == tuple(uninterrupted(engine, PROMPT, 30, GREEDY))
    # The blocks before the prompt's last token, then the rest of the prompt.
    assert len(last.prompt_blocks) == (len(PROMPT) - 1) // 8
    assert last.prompt_tail == tuple(PROMPT[8 * len(last.prompt_blocks) :])
    assert last.sampler.step == 30 and last.limits is not None and last.limits.max_tokens == 30
    assert pc.ended == [session.id]
    await sessions.close()


async def test_a_non_deterministic_sampler_releases_only_acknowledged_tokens(
    engine: ReferenceEngine,
) -> None:
    pc = Controller(A)
    pc.delay_s = 0.02
    sessions = make(engine, controller=pc, release_tokens=3)
    session = sessions.begin(request(PROMPT, 16, TOP_P))
    seen: list[tuple[int, int]] = []
    async with asyncio.timeout(60):
        async for event in sessions.follow(session):
            if "index" in event:
                # CK3: when a token is out, an ack covering it was given.
                acked = max((o for e, o in pc.acks if e == 1), default=0)
                seen.append((event["index"], acked))
    assert all(index < acked for index, acked in seen) and len(seen) == 16
    assert [i for i, _ in seen] == list(range(16))
    assert [t for t in session.generated] == uninterrupted(engine, PROMPT, 16, TOP_P)
    await sessions.close()


async def test_a_newer_epoch_at_the_pc_stops_the_session(engine: ReferenceEngine) -> None:
    state = MemoryControllerState()
    pc = Controller(A, state)
    sessions = make(engine, controller=pc, checkpoint_tokens=2, token_interval_ms=10.0)
    session = sessions.begin(request(PROMPT, 200))
    while len(pc.checkpoints) < 2:
        await asyncio.sleep(0.01)
    await state.assign(session.id, B, 2)  # the PC moved it (CK5)
    events = await output(sessions, session)
    assert events[-1]["event"] == "moved" and session.state == "moved"  # CK7
    assert len(session.generated) < 200
    await sessions.close()


async def test_resume_continues_the_uninterrupted_output(engine: ReferenceEngine) -> None:
    pc_state = MemoryControllerState()
    pc_a = Controller(A, pc_state)
    store = TieredStore([(HostTier(), 64 << 20)])
    a = make(engine, controller=pc_a, store=store, checkpoint_tokens=7)
    session = a.begin(request(PROMPT, 40, TOP_P))
    while (pc_a.checkpoints[-1].output_offset if pc_a.checkpoints else 0) < 17:
        await asyncio.sleep(0.005)
    await a.close()  # "killed"
    await asyncio.sleep(0.05)
    entry = await pc_state.session(session.id)
    checkpoint = entry.checkpoint
    assert checkpoint is not None and 17 <= checkpoint.output_offset < 40
    await pc_state.assign(session.id, B, 2)
    # B holds what A stored (in the deployment: fetched through the IS).
    pc_b = Controller(B, pc_state)
    b = make(engine, instance=B, controller=pc_b, store=store)
    resumed = await b.resume(ResumeRequest(2, checkpoint), session.id)
    stats = resumed.stats
    assert stats["resumed_from"] == checkpoint.output_offset
    assert stats["loaded_tokens"] >= len(checkpoint.prompt_blocks) * 8
    events = await output(b, resumed)
    expected = uninterrupted(engine, PROMPT, 40, TOP_P)
    assert tokens(events) == expected  # the checkpointed ones, then the rest
    assert {e["epoch"] for e in events if "index" in e} == {2}
    assert pc_b.checkpoints[0].epoch == 2 and pc_b.ended == [session.id]
    # A's late checkpoint with the old epoch is refused (CK7).
    with pytest.raises(StaleEpoch):
        await pc_a.put_checkpoint(checkpoint)
    await b.close()


async def test_resume_recomputes_what_no_block_covers(engine: ReferenceEngine) -> None:
    pc = Controller(A)
    a = make(engine, controller=pc, checkpoint_tokens=4)
    session = a.begin(request(PROMPT, 12))
    await output(a, session)
    checkpoint = next(c for c in pc.checkpoints if c.output_offset >= 4)
    fresh = make(engine, instance=B, controller=None, store=TieredStore([(HostTier(), 1 << 26)]))
    # Nothing is held at B and there is no IS: the prompt blocks cannot load.
    with pytest.raises(InvalidState, match="prompt blocks"):
        await fresh.resume(ResumeRequest(2, checkpoint), session.id)
    # With the prompt blocks only, the generated part is recomputed.
    for key in checkpoint.prompt_blocks:
        ref = BlockRef(a.compat_id, SCOPE, key)
        await fresh.store.put(ref, await a.store.get(ref))
    resumed = await fresh.resume(ResumeRequest(2, checkpoint), session.id)
    blocks = len(checkpoint.prompt_blocks)
    assert resumed.stats["loaded_tokens"] == blocks * 8
    assert resumed.stats["computed_tokens"] == (
        len(checkpoint.prompt_tail) + checkpoint.output_offset
    )
    events = await output(fresh, resumed)
    assert tokens(events) == uninterrupted(engine, PROMPT, 12, GREEDY)
    await a.close()
    await fresh.close()


async def test_admission_rules(engine: ReferenceEngine) -> None:
    sessions = make(engine)
    with pytest.raises(Forbidden, match="scope"):
        sessions.begin(dataclasses.replace(request(PROMPT, 2), scope_id="0" * 32))
    sessions.lifecycle.state = "draining"
    with pytest.raises(InvalidState, match="draining"):
        sessions.begin(request(PROMPT, 2))
    sessions.lifecycle.state = "active"
    checkpoint = SessionCheckpoint(
        str(uuid.uuid4()), 1, "ab" * 32, SCOPE, (), tuple(PROMPT), (), 0, GREEDY
    )
    with pytest.raises(Incompatible):
        await sessions.resume(ResumeRequest(2, checkpoint), checkpoint.session)
    empty = dataclasses.replace(checkpoint, compat_id=sessions.compat_id, prompt_tail=())
    with pytest.raises(BadRequest, match="no token"):
        await sessions.resume(ResumeRequest(2, empty), checkpoint.session)
    # A session known here at a higher epoch is not taken back (CK7).
    good = dataclasses.replace(checkpoint, compat_id=sessions.compat_id)
    resumed = await sessions.resume(ResumeRequest(3, good), good.session)
    with pytest.raises(StaleEpoch):
        await sessions.resume(ResumeRequest(2, good), good.session)
    assert resumed.epoch == 3
    await sessions.close()


async def test_stop_tokens_end_the_output(engine: ReferenceEngine) -> None:
    sessions = make(engine)
    expected = uninterrupted(engine, PROMPT, 10, GREEDY)
    stop = expected[3]
    session = sessions.begin(request(PROMPT, 10, stop_tokens=(stop, EOS)))
    events = await output(sessions, session)
    got = tokens(events)
    assert got == expected[: expected.index(stop) + 1]
    await sessions.close()


def test_generate_requests_are_validated() -> None:
    def parse(body: dict[str, Any]) -> GenerateRequest:
        return GenerateRequest.from_json(body, max_prompt=100, max_output=50)

    ok = parse(
        {
            "scope_id": SCOPE,
            "tokens": [1, 2],
            "sampler": {"method": "top-p", "params": {"p": 0.5}, "seed": 3},
        }
    )
    assert ok.sampler.params == {"p": 0.5, "temperature": 1.0} and not ok.sampler.deterministic
    assert uuid.UUID(ok.session) and ok.max_tokens == 50  # the default, capped
    for bad in (
        {"scope_id": SCOPE, "tokens": []},
        {"scope_id": SCOPE, "tokens": [1] * 101},
        {"scope_id": SCOPE, "tokens": [1], "max_tokens": 51},
        {"scope_id": SCOPE, "tokens": [1], "sampler": {"method": "beam"}},
        {"scope_id": SCOPE, "tokens": [1], "sampler": {"method": "top-p", "params": {"p": 2}}},
        {"scope_id": "x", "tokens": [1]},
        {"scope_id": SCOPE, "tokens": [-1]},
    ):
        with pytest.raises(BadRequest):
            parse(bad)


async def test_a_draining_instance_finishes_its_sessions_then_sleeps(
    engine: ReferenceEngine,
) -> None:
    # S4, S5: draining admits no new session, completes the running one, and
    # reports sleeping once none is left; Load follows the sessions.
    from kvstore.instance.reporter import StatusReporter

    sessions = make(engine, token_interval_ms=10.0)
    reporter = StatusReporter(A, None, sessions.lifecycle, sessions.load)
    session = sessions.begin(request(PROMPT, 30))
    assert sessions.load.running == 1
    sessions.lifecycle.set_by_pc("draining")
    with pytest.raises(InvalidState):
        sessions.begin(request(PROMPT, 2))
    assert reporter.status().state == "draining"
    events = await output(sessions, session)
    assert events[-1]["event"] == "done" and len(tokens(events)) == 30
    assert sessions.load.running == 0 and reporter.status().state == "sleeping"
    await sessions.close()


async def test_engine_rates_are_measured(engine: ReferenceEngine) -> None:
    # R3: the status reports measured prefill and decode rates.
    sessions = make(engine)
    await sessions.calibrate(tokens=32, steps=2)
    assert sessions.load.prefill_tokens_per_s > 0 and sessions.load.decode_tokens_per_s > 0
    await sessions.close()


async def test_deterministic_greedy_releases_at_once(engine: ReferenceEngine) -> None:
    # CK3's deterministic case (greedy_deterministic = true: an operator's
    # claim of batch-invariant kernels): tokens go out before any ack.
    pc = Controller(A)
    pc.delay_s = 0.05
    sessions = make(engine, controller=pc, greedy_deterministic=True, checkpoint_tokens=8)
    session = sessions.begin(request(PROMPT, 12))
    assert session.sampler.deterministic
    early = None
    async with asyncio.timeout(60):
        async for event in sessions.follow(session):
            if event.get("index") == 3:
                early = max((o for _, o in pc.acks), default=0)
    assert early is not None and early < 4  # index 3 was out before an ack covered it
    await sessions.close()


async def test_review_fixes_for_resume(engine: ReferenceEngine) -> None:
    sessions = make(engine)
    base = SessionCheckpoint(
        str(uuid.uuid4()), 1, sessions.compat_id, SCOPE, (), tuple(PROMPT), (), 0, GREEDY
    )
    # A checkpoint whose output already ended (the end never reached the PC)
    # finishes at once: nothing past the stop token (or max_tokens).
    from kvstore.protocol.control import GenerationLimits

    ended = dataclasses.replace(
        base,
        session=str(uuid.uuid4()),
        generated=(5, 9),
        output_offset=2,
        sampler=dataclasses.replace(GREEDY, step=2),
        limits=GenerationLimits(10, (9,)),
    )
    done = await sessions.resume(ResumeRequest(2, ended), ended.session)
    events = await output(sessions, done)
    assert tokens(events) == [5, 9] and events[-1]["event"] == "done"
    assert done.stats.get("computed_tokens") is None  # nothing was recomputed
    # Bad samplers and steps are refused before anything runs.
    for bad in (
        dataclasses.replace(base, sampler=Sampler("top-p", 1, 0, False, {"p": 0})),
        dataclasses.replace(base, sampler=dataclasses.replace(GREEDY, step=3)),
        dataclasses.replace(base, sampler=Sampler("beam", 1, 0, False)),
    ):
        with pytest.raises(BadRequest):
            await sessions.resume(ResumeRequest(2, bad), base.session)
    # Two resumes of one session at once: the second is refused while the
    # first restores, so no orphan decodes beside it.
    first = asyncio.create_task(sessions.resume(ResumeRequest(2, base), base.session))
    await asyncio.sleep(0)
    with pytest.raises(InvalidState, match="in progress"):
        await sessions.resume(ResumeRequest(3, base), base.session)
    resumed = await first
    await output(sessions, resumed)
    assert resumed.generation is None  # a finished session lets its KV go
    await sessions.close()


async def test_a_reused_session_id_at_the_pc_fails_the_run(engine: ReferenceEngine) -> None:
    # The PC holds a longer checkpoint of the same id and epoch (an earlier
    # run, before a restart): its ack must not release this run's tokens.
    pc = Controller(A)
    sessions = make(engine, controller=pc)
    session_id = str(uuid.uuid4())
    old = SessionCheckpoint(
        session_id,
        1,
        sessions.compat_id,
        SCOPE,
        (),
        tuple(PROMPT),
        tuple(range(33)),
        33,
        dataclasses.replace(TOP_P, step=33),
    )
    await pc.put_checkpoint(old)
    session = sessions.begin(dataclasses.replace(request(PROMPT, 40, TOP_P), session=session_id))
    events = await output(sessions, session)
    assert events[-1]["event"] == "error" and "another run" in events[-1]["detail"]
    assert not tokens(events)
    await sessions.close()
