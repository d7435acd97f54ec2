"""Engine integrations (issue 10) run in the engines' virtualenv
(``.venv-engines``, ``make engines``), each test module in a pytest process
of its own: LMCache sets process-wide state (the multiprocessing start
method, singletons) and SGLang needs import stubs. ``make test`` runs them;
in the main virtualenv, where neither engine is installed, the modules are
not collected (``make unit`` passes ``--ignore=tests/engines``)."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .holder import Holder, start_holder

# LMCache: no usage telemetry (a thread posting to lmcache.ai), less noise.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    """A real holder process (uvicorn, mTLS, host memory) for the test."""
    found = start_holder(tmp_path)
    yield found
    found.stop()
