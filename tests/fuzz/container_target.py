"""atheris target for the container decoder and the stream decoder (issue 9):
run by tests/test_fuzz.py for a bounded number of inputs. Any exception other
than our own KvspError, or a MemoryError from a lying length, is a crash."""

from __future__ import annotations

import contextlib
import sys
import tracemalloc

import atheris

with atheris.instrument_imports():
    from kvstore.protocol import container as kc
    from kvstore.protocol.problems import KvspError
    from kvstore.protocol.stream import StreamDecoder

SEED = bytes(kc.encode([(bytes(range(64)), bytes(64)), (b"k" * 64, b"v" * 64)], token_count=4))


#: No input may make the decoders allocate more than this (a lying length
#: believed); measured per input with tracemalloc, whatever the process's RSS.
PEAK_LIMIT = 64 << 20


def target(data: bytes) -> None:
    tracemalloc.reset_peak()
    with contextlib.suppress(KvspError):
        kc.decode(data)
    # The stream decoder, fed in two pieces at a point the input chooses.
    cut = data[0] % (len(data) + 1) if data else 0
    decoder = StreamDecoder()
    try:
        decoder.feed(data[:cut])
        decoder.feed(data[cut:])
    except KvspError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    if peak > PEAK_LIMIT:
        raise MemoryError(f"an input of {len(data)} octets made the decoders allocate {peak}")


if __name__ == "__main__":
    # argv: libFuzzer's (-atheris_runs=N, -max_len=N, a corpus directory).
    tracemalloc.start()
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()
