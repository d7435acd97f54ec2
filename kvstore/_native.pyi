from collections.abc import Sequence
from typing import Any

def hex_keys(octets: bytes | bytearray | memoryview, /) -> list[str]: ...
def all_hex32(values: Any, /) -> bool: ...
def walk(
    groups: dict[str, tuple[str, bytes, bytes, float]],
    keys: Sequence[str],
    start: int,
    kind: str,
    now: float,
    records: list[Any] | None,
    shapes: list[Any] | None,
    /,
) -> int: ...
