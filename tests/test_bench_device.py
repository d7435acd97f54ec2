"""``python -m kvstore.bench.device`` (scripts/device-check.sh) on the CPU:
every section runs, checks what it moved and gives its rows, so that the
one call on a GPU machine does not find it broken. Nothing here asserts on
speed."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.bench import device


def test_every_section_runs_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "device.txt"
    assert device.main(["--device", "cpu", "--quick", "--append", str(table)]) == 0
    text = table.read_text()
    assert text in capsys.readouterr().out
    assert text.startswith("device cpu, torch ")
    for row in (
        "holder GET verified into cpu memory, K=1",
        "gather 32 pages x 32 layers, kv-first, cpu -> host",
        "scatter_layer host -> 32 pages x 32 layers, content, cpu",
        "reference engine on cpu, 1024-token prompt: loaded from a holder",
    ):
        assert row in text
    assert "FAILED" not in text and "LOW" not in text


def test_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert device.main(["--device", "cuda", "--section", "paged"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
