"""Byte-buffer types of the protocol core (3.11 lacks ``collections.abc.Buffer``)."""

from typing import TypeAlias

#: Anything the core reads octets from without copying.
BytesLike: TypeAlias = bytes | bytearray | memoryview
