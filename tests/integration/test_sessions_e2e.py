"""End-to-end scenarios with real processes over mutual TLS (issue 7):
a holder, an IS+PC process and two inference instances on the reference
engine (:class:`kvstore.demo.Cluster`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.demo import Cluster, migration, prefix_reuse, resharding

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path, token_interval_ms=40, block_tokens=16) as running:
        yield running


def logs(cluster: Cluster) -> str:
    return "\n".join(f"--- {n.name}\n{n.log.read_text()[-3000:]}" for n in cluster.nodes.values())


async def test_prefix_reuse_then_migration_after_sigkill(cluster: Cluster) -> None:
    # 1. Prefix reuse (PL1, PL2, PF1-PF3, P1): b is placed for a prompt that
    # shares a's prefix, prefetches it and recomputes only the rest.
    reuse = await prefix_reuse(cluster, n=12)
    first, second = reuse["first"], reuse["second"]
    assert first["stats"]["loaded_tokens"] == 0
    assert reuse["placement"]["instance"] == cluster.uris["b"], reuse["placement"]
    assert reuse["placement"]["matched"] >= reuse["shared_blocks"] > 0
    assert reuse["placement"]["prefetch"]["blocks"] >= reuse["shared_blocks"], logs(cluster)
    shared_tokens = reuse["shared_blocks"] * 16
    assert second["stats"]["loaded_tokens"] == shared_tokens, logs(cluster)
    assert second["stats"]["computed_tokens"] == second["prompt_tokens"] - shared_tokens
    # The same greedy tokens as a full recompute, with the chosen tokens'
    # log-probabilities within 1e-4 of it (fp32 on CPU).
    prompt = second["prompt"]
    assert second["tokens"] == cluster.uninterrupted(prompt, 12, {})
    run = cluster.engine.prefill(prompt)
    for token, logprob in zip(second["tokens"], second["logprobs"], strict=True):
        expected = torch.log_softmax(run.logits.double(), dim=-1)[token].item()
        assert abs(logprob - expected) < 1e-4
        cluster.engine.extend(run, token)

    # Operators see both instances at the PC, active, with measured rates.
    from kvstore.ops import gather

    views = await gather([cluster.uris["pc"], cluster.uris["b"]], cluster.context("ops"))
    listed = {i["instance"]: i for i in views[0].summary()["instances"]}
    assert set(listed) == {cluster.uris["a"], cluster.uris["b"]}
    assert all(i["state"] == "active" and i["prefill_tokens_per_s"] > 0 for i in listed.values())
    # OPS1 at b: the prefix it fetched versus what it recomputed.
    b = views[1].summary()
    assert b["roles"] == ["instance"] and b["fetched_tokens"] >= shared_tokens

    # 2. Migration (CK3-CK7): a is killed mid-session; the PC moves the
    # session to b at epoch 2; the front end's output is the uninterrupted
    # greedy output, each index once.
    moved = await migration(cluster, n=64, kill_after=12)
    assert not cluster.nodes["a"].alive
    assert moved["tokens"] == cluster.uninterrupted(moved["prompt"], 64, {}), logs(cluster)
    assert moved["indexes"] == list(range(64))
    assert moved["resumed"] is not None and moved["resumed"]["epoch"] == 2
    assert set(moved["epochs"][:12]) == {1} and moved["epochs"][-1] == 2
    # b restored from the checkpoint: the prompt's blocks (at least) loaded.
    stats = moved["end"]["stats"]
    assert stats["resumed_from"] == moved["resumed"]["resumed_from"] > 0
    assert stats["loaded_tokens"] >= 16 * ((len(moved["prompt"]) - 1) // 16)
    # Events from b below its checkpoint (already delivered by a) were dropped.
    raw = [(e["index"], e["epoch"]) for e in moved["events"] if "index" in e]
    assert len(raw) >= 64 and len({i for i, _ in raw}) == 64


async def test_a_non_deterministic_session_never_shows_an_unacknowledged_token(
    cluster: Cluster,
) -> None:
    # CK3: with top-p, a releases a token only once the PC acknowledged a
    # checkpoint covering it; after the kill, b resumes from the PC's latest
    # checkpoint, so nothing a showed is ever regenerated differently.
    sampler = {"method": "top-p", "params": {"p": 0.9}, "seed": 11}
    moved = await migration(cluster, n=48, kill_after=10, sampler=sampler)
    assert moved["indexes"] == list(range(48)), logs(cluster)
    from_a = [e["index"] for e in moved["events"] if "index" in e and e["epoch"] == 1]
    resumed_from = moved["resumed"]["resumed_from"]
    # Every token a released was covered by the checkpoint b resumed from.
    assert from_a and max(from_a) < resumed_from
    # Our sampler draws from (seed, step), so the whole output is the
    # uninterrupted one too.
    assert moved["tokens"] == cluster.uninterrupted(moved["prompt"], 48, sampler)
    assert json.dumps(moved["end"]["stats"])  # b's end carries its stats


async def test_reshard_two_to_three_and_back_then_an_abort(tmp_path: Path) -> None:
    # Scenario 4 (RS1-RS7): retained ranges never move (RS3), members answer
    # once loaded (RS4), release after the commit (RS5), and a member that
    # does not answer (SIGSTOP) aborts the reshard for everyone (RS6).
    with Cluster(tmp_path, block_tokens=16, instances=("a", "b", "c")) as cluster:
        out = await resharding(cluster, blocks=8)
    container = 20 + 16 * 4 + out["block_octets"]  # header, layer table, data

    def moved(snapshot: dict[str, Any]) -> tuple[int, int]:
        return (
            sum(s["blocks_fetched"] for s in snapshot.values()),
            sum(s["octets_fetched"] for s in snapshot.values()),
        )

    assert moved(out["before"]) == (0, 0)
    assert out["split"]["committed"] and out["split"]["version"] == 2
    after = out["after_split"]
    # v1 a [0,64) b [64,128) -> v2 a [0,32) b [32,64) c [64,128): a keeps
    # [0,32) in place, b fetches [32,64) from a, c fetches [64,128) from b.
    assert after["a"]["held"] == [[0, 32]] and after["a"]["blocks_fetched"] == 0
    assert after["b"]["held"] == [[32, 64]] and after["b"]["blocks_fetched"] == 2
    assert after["c"]["held"] == [[64, 128]] and after["c"]["blocks_fetched"] == 4
    assert moved(after) == (6, 6 * container)
    assert after["a"]["blocks_released"] == 2 and after["b"]["blocks_released"] == 4
    # Back to v1's layout: a fetches [32,64) from b, b fetches [64,128) from c.
    assert out["merge"]["committed"] and out["merge"]["version"] == 3
    merged = out["after_merge"]
    assert merged["a"]["held"] == [[0, 64]] and merged["b"]["held"] == [[64, 128]]
    assert merged["c"]["held"] == [] and merged["c"]["blocks_released"] == 4
    assert moved(merged) == (12, 12 * container)
    # c stopped: no ack by the deadline, so the PC aborted (RS6) and v3 stays.
    assert "Reshard aborted" in out["aborted"] or "502" in out["aborted"]
    assert out["current"]["version"] == 3 and out["current"]["resharding_to"] is None
    for name in ("a", "b"):
        state = out["after_abort"][name]
        assert state["version"] == 3 and state["resharding_to"] is None
        assert state["fetched"] == [] and state["held"] == merged[name]["held"]
