"""``kvstore bench protocol``: block keys and container encode/decode speed.

Baselines, measured in the same run on the same data:

* block keys: a bare loop of ``hmac.digest`` over the precomputed messages
  of the same chain (the HMACs themselves, with no packing or chaining);
* container: one ``hashlib.sha256`` pass over the block's data octets.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random

from kvstore.protocol import container as kc
from kvstore.protocol.keys import BLOCK_LABEL, BlockKeyChain, pack_tokens

from . import Result, best_seconds

SCOPE_KEY = bytes(range(32))
COMPAT_ID = hashlib.sha256(b"bench").digest()


def bench_block_keys(tokens: int, block: int, repeat: int) -> Result:
    rng = random.Random(7)
    prompt = [rng.randrange(150_000) for _ in range(tokens)]
    keys = BlockKeyChain(SCOPE_KEY, COMPAT_ID, block).extend(prompt)
    packed = pack_tokens(prompt)
    step = 4 * block
    prefix = BLOCK_LABEL + COMPAT_ID
    # The exact messages the chain hashes, built ahead of time.
    messages = [
        prefix + (keys[i - 1] if i else bytes(32)) + packed[i * step : (i + 1) * step]
        for i in range(len(keys))
    ]

    def baseline() -> None:
        digest = hmac.digest
        for message in messages:
            digest(SCOPE_KEY, message, "sha256")

    def ours() -> None:
        BlockKeyChain(SCOPE_KEY, COMPAT_ID, block).extend(prompt)

    base = best_seconds(baseline, repeat=repeat)
    got = best_seconds(ours, repeat=repeat)
    return Result(
        f"block keys, {tokens // 1024}k tokens, B={block}",
        "M tokens/s",
        tokens / got / 1e6,
        "bare hmac.digest loop",
        tokens / base / 1e6,
        goal=0.8,
    )


def bench_container(block_octets: int, layers: int, repeat: int) -> list[Result]:
    section = block_octets // (2 * layers)
    sections = [(os.urandom(section), os.urandom(section)) for _ in range(layers)]
    data = b"".join(k + v for k, v in sections)
    gb = len(data) / 1e9

    def baseline() -> None:
        hashlib.sha256(data).digest()

    def encode_and_digest() -> None:
        blob = kc.encode(sections, token_count=16)
        digests = [kc.layer_digest(k, v) for k, v in sections]
        kc.replica_digest(digests)
        del blob

    blob = bytes(kc.encode(sections, token_count=16))
    digests = [kc.layer_digest(k, v) for k, v in sections]
    replica = kc.replica_digest(digests)

    def decode_and_verify() -> None:
        kc.decode(blob).verify(digests, replica)

    base = best_seconds(baseline, repeat=repeat)
    enc = best_seconds(encode_and_digest, repeat=repeat)
    dec = best_seconds(decode_and_verify, repeat=repeat)
    mib = block_octets / (1 << 20)
    return [
        Result(
            f"container encode+digest, {mib:g} MiB, {layers} layers",
            "GB/s",
            gb / enc,
            "one sha256 pass",
            gb / base,
            goal=0.8,
        ),
        Result(
            f"container decode+verify, {mib:g} MiB, {layers} layers",
            "GB/s",
            gb / dec,
            "one sha256 pass",
            gb / base,
            goal=0.8,
        ),
    ]


def run(quick: bool = False) -> list[Result]:
    """All protocol benchmarks; ``quick`` shrinks them for a smoke run."""
    repeat = 2 if quick else 7
    tokens = 16 * 1024 if quick else 128 * 1024
    results = [bench_block_keys(tokens, 16, repeat), bench_block_keys(tokens, 4, repeat)]
    results += bench_container(2 << 20, 32, repeat * 3)
    return results
