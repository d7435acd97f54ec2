"""Model and tokenizer digests (C5)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvstore.digests import model_digest, tokenizer_digest, weight_files


def test_byte_order_of_names_not_locale_order(tmp_path: Path) -> None:
    # "B" (0x42) sorts before "a" (0x61) in byte order.
    (tmp_path / "a.safetensors").write_bytes(b"lower")
    (tmp_path / "B.safetensors").write_bytes(b"upper")
    assert [p.name for p in weight_files(tmp_path)] == ["B.safetensors", "a.safetensors"]
    assert model_digest(tmp_path) == "sha-256:" + hashlib.sha256(b"upperlower").hexdigest()


def test_prefers_safetensors_over_duplicate_bin(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"st")
    (tmp_path / "pytorch_model.bin").write_bytes(b"bin")
    assert model_digest(tmp_path) == "sha-256:" + hashlib.sha256(b"st").hexdigest()
    assert model_digest(tmp_path, ["*.bin"]) == "sha-256:" + hashlib.sha256(b"bin").hexdigest()


def test_large_file_hashes_in_chunks(tmp_path: Path) -> None:
    data = bytes(range(256)) * 20000  # ~5 MB, several chunks
    (tmp_path / "w.safetensors").write_bytes(data)
    assert model_digest(tmp_path) == "sha-256:" + hashlib.sha256(data).hexdigest()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        model_digest(tmp_path)
    with pytest.raises(NotADirectoryError):
        model_digest(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        tokenizer_digest(tmp_path / "missing.json")
