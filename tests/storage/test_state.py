"""The block lifecycle table and the per-block claim (kvstore/storage/state.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.storage.state import (
    HELD,
    SERVING,
    SETTLING,
    BlockState,
    Claim,
    Event,
    StateError,
    advance,
)

W, R, L, G = BlockState.WRITING, BlockState.RESIDENT, BlockState.LEAVING, BlockState.GONE

ALLOWED = {
    (None, Event.PUT): W,
    (None, Event.RECOVERED): R,
    (W, Event.STORED): R,
    (W, Event.FAILED): G,
    (R, Event.LEAVE): L,
    (L, Event.DELETED): G,
}


@pytest.mark.parametrize("state", [None, *BlockState])
@pytest.mark.parametrize("event", list(Event))
def test_every_transition_is_in_the_table_and_no_other(
    state: BlockState | None, event: Event
) -> None:
    if (state, event) in ALLOWED:
        assert advance(state, event) is ALLOWED[(state, event)]
    else:
        with pytest.raises(StateError, match=event.value):
            advance(state, event)


def test_what_each_state_allows() -> None:
    assert {R} == SERVING  # read, leased, moved
    assert {R, L} == HELD  # the data is still in the tiers
    assert {W, L} == SETTLING  # a second PUT waits for these
    assert G not in HELD | SETTLING


async def test_a_claim_is_reentrant_for_its_task_and_exclusive_for_others() -> None:
    claim = Claim()
    assert claim.try_take() and claim.try_take()  # re-entrant
    assert claim.owned

    async def other() -> bool:
        return claim.try_take()

    assert not await asyncio.create_task(other())
    claim.give()
    assert claim.taken  # still held once
    waiting = asyncio.create_task(claim.take())
    await asyncio.sleep(0)
    assert not waiting.done()
    claim.give()
    await asyncio.wait_for(waiting, 1)
    assert claim.taken and not claim.owned  # the waiter's now
