"""Model and tokenizer digests for the Compatibility Descriptor (C5).

``model_digest`` is SHA-256 over the weight files concatenated in ascending
byte order of their file names; ``tokenizer_digest`` is SHA-256 of the
tokenizer definition file. Both read in fixed-size chunks into one reused
buffer, so multi-gigabyte checkpoints hash in constant memory.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

#: Weight files looked for, in this order of preference: the first pattern
#: that matches anything wins (a Hugging Face directory often carries the
#: same weights as both .safetensors and .bin; hashing both would be wrong).
DEFAULT_WEIGHT_PATTERNS: tuple[tuple[str, ...], ...] = (
    ("*.safetensors",),
    ("*.bin", "*.pt", "*.pth"),
    ("*.gguf",),
)
_CHUNK = 1 << 20


def weight_files(directory: Path, patterns: Sequence[str] | None = None) -> list[Path]:
    """The weight files of a model directory, in ascending byte order of their names."""
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")
    groups = (tuple(patterns),) if patterns else DEFAULT_WEIGHT_PATTERNS
    for group in groups:
        found = {p for pattern in group for p in directory.rglob(pattern) if p.is_file()}
        if found:
            # C5: byte order of the names (relative to the directory), not locale order.
            return sorted(found, key=lambda p: os.fsencode(p.relative_to(directory).as_posix()))
    wanted = ", ".join(p for group in groups for p in group)
    raise FileNotFoundError(f"no weight files ({wanted}) under {directory}")


def _hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    for path in paths:
        with path.open("rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
    return "sha-256:" + digest.hexdigest()


def model_digest(directory: str | os.PathLike[str], patterns: Sequence[str] | None = None) -> str:
    """``model_digest`` of the weights under ``directory`` (C5)."""
    return _hash_files(weight_files(Path(directory), patterns))


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """``tokenizer_digest`` of a tokenizer definition file (C5)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{file} is not a file")
    return _hash_files([file])
