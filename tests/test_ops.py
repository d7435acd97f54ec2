"""``kvstore status`` and ``top`` (kvstore.ops): rates from two scrapes, the
development server's URIs and certificates by default, ``q`` quits."""

from __future__ import annotations

import asyncio
import io
import os
import pty
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from kvstore.clibase import default_certs, default_health_url, default_urls
from kvstore.ops import RoleView, parse_metrics, rates, render, top

from .conftest import free_port

SCRAPE = """# TYPE kvstore_http_requests counter
kvstore_http_requests_total{{route="get_block",method="GET",status="200"}} {requests}
# TYPE kvstore_http_sent_bytes counter
kvstore_http_sent_bytes_total{{route="get_block"}} {sent}
# TYPE kvstore_store_hits counter
kvstore_store_hits_total {hits}
# TYPE kvstore_tier_used_bytes gauge
kvstore_tier_used_bytes{{tier="host",position="0"}} 10
"""


def view(at: float, requests: int, sent: int, hits: int) -> RoleView:
    samples = parse_metrics(SCRAPE.format(requests=requests, sent=sent, hits=hits))
    return RoleView("https://h:8443/kvsp/", roles=["holder"], samples=samples, at=at)


def test_rates_between_two_scrapes() -> None:
    before, after = view(10.0, 100, 0, 40), view(12.0, 300, 4 << 20, 140)
    speed = rates(before, after)
    assert speed["requests"] == 100.0 and speed["hits"] == 50.0
    assert speed["out"] == 2.0  # MiB/s: 4 MiB in 2 s
    assert "in" not in speed  # no series of octets received
    assert "lookups" not in speed  # not a series of this role
    # A counter that went down: the process restarted in between.
    assert rates(after, view(13.0, 5, 0, 1))["requests"] is None
    assert rates(after, after) == {}  # no time between them


def test_render_shows_the_rates_and_a_restart() -> None:
    before, after = view(10.0, 100, 0, 40), view(12.0, 300, 4 << 20, 140)
    out = io.StringIO()
    Console(file=out, width=200).print(
        render([after], {after.base: rates(before, after)}, header="kvstore top")
    )
    text = out.getvalue()
    assert "kvstore top" in text
    assert "rates: 100 req/s, 2.0 MiB/s out, 50 hits/s" in text.replace("\n", " ")
    out = io.StringIO()
    Console(file=out, width=200).print(
        render([after], {after.base: rates(after, view(13, 1, 0, 1))})
    )
    assert "restarted req/s" in out.getvalue()


def test_the_development_server_is_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVSTORE_URL", raising=False)
    monkeypatch.delenv("KVSTORE_CERTS", raising=False)
    assert default_urls() == [
        "https://127.0.0.1:8443/kvsp/",
        "https://127.0.0.1:8443/is/",
        "https://127.0.0.1:8443/pc/",
    ]
    assert default_health_url() == "https://127.0.0.1:8443/readyz"
    assert default_certs() == ".kvstore/certs"
    # As kvstore serve --port 9555 made it.
    (tmp_path / ".kvstore").mkdir()
    (tmp_path / ".kvstore" / "kvstore.toml").write_text(
        '[holder]\nuri = "https://127.0.0.1:9555/kvsp/"\n[index]\nuri = "https://127.0.0.1:9555/is/"\n'
    )
    assert default_urls() == ["https://127.0.0.1:9555/kvsp/", "https://127.0.0.1:9555/is/"]
    assert default_health_url() == "https://127.0.0.1:9555/readyz"
    monkeypatch.setenv("KVSTORE_URL", "https://a:1/kvsp/, https://b:2/pc/")
    monkeypatch.setenv("KVSTORE_CERTS", "/etc/kvstore/certs")
    assert default_urls() == ["https://a:1/kvsp/", "https://b:2/pc/"]
    assert default_health_url() == "https://a:1/readyz"
    assert default_certs() == "/etc/kvstore/certs"


async def test_top_draws_rounds_then_stops() -> None:
    out = io.StringIO()
    base = f"http://127.0.0.1:{free_port()}/kvsp/"  # nothing listens: an error view
    drawn = await top([base], None, interval=0.01, rounds=3, console=Console(file=out))
    assert drawn == 3
    assert "kvstore top" in out.getvalue() and "cannot connect" in out.getvalue()


async def test_q_quits_top(monkeypatch: pytest.MonkeyPatch) -> None:
    controller, terminal = pty.openpty()
    stdin = os.fdopen(terminal, "r")
    monkeypatch.setattr(sys, "stdin", stdin)
    base = f"http://127.0.0.1:{free_port()}/kvsp/"
    out = io.StringIO()
    try:
        started = time.monotonic()
        running = asyncio.create_task(top([base], None, interval=30, console=Console(file=out)))
        await asyncio.sleep(0.3)
        assert not running.done()  # waiting its 30 s interval
        os.write(controller, b"q")
        drawn = await asyncio.wait_for(running, 5)
        assert drawn == 1 and time.monotonic() - started < 10
        assert "q quits" in out.getvalue()
        import termios

        assert termios.tcgetattr(terminal)[3] & termios.ECHO  # the terminal as it was
    finally:
        stdin.close()
        os.close(controller)


def test_status_shows_each_tier_s_p99_from_its_histogram() -> None:
    text = SCRAPE.format(requests=1, sent=1, hits=1) + (
        "# TYPE kvstore_tier_capacity_bytes gauge\n"
        'kvstore_tier_capacity_bytes{tier="host",position="0"} 100\n'
        "# TYPE kvstore_tier_operation_duration_seconds histogram\n"
        + "".join(
            f'kvstore_tier_operation_duration_seconds_bucket{{tier="host",position="0",'
            f'op="read",le="{le}"}} {n}\n'
            for le, n in (("5e-05", 50), ("0.0001", 98), ("0.00025", 100), ("+Inf", 100))
        )
        + 'kvstore_tier_operation_duration_seconds_count{tier="host",position="0",op="read"} 100\n'
        + 'kvstore_tier_operation_duration_seconds_sum{tier="host",position="0",op="read"} 0.01\n'
    )
    view = RoleView("https://h:8443/kvsp/", roles=["holder"], samples=parse_metrics(text))
    [tier] = view.summary()["tiers"]
    assert tier["read_p99_s"] == 0.00025 and tier["write_p99_s"] is None
    out = io.StringIO()
    Console(file=out, width=200).print(render([view]))
    assert "<= 0.25 ms" in out.getvalue()
