"""Log lines (kvstore.logs): messages not reprs, one format for every logger
(text or JSON, the same fields), the access log, counted bursts."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys

import aiohttp
import pytest

from kvstore.logs import (
    ACCESS,
    ACCESS_TEXT,
    JsonFormatter,
    Tally,
    TextFormatter,
    describe,
)
from kvstore.protocol.problems import NotFound
from kvstore.storage.errors import TierUnavailable


def record(
    message: str = "hello %s", args: tuple[object, ...] = ("there",), **extra: object
) -> logging.LogRecord:
    made = logging.LogRecord("kvstore.storage", logging.WARNING, __file__, 1, message, args, None)
    made.__dict__.update(extra)
    return made


async def test_a_refused_connection_is_described_not_repr_d() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            await http.get(f"http://127.0.0.1:{port}/")
    said = describe(refused.value)
    assert said == f"cannot connect to 127.0.0.1:{port}: connection refused"
    assert "ConnectionKey" not in said and "(" not in said


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (TimeoutError(), "timed out"),
        (TimeoutError("after 5 s"), "timed out (after 5 s)"),
        (
            FileNotFoundError(2, "No such file or directory", "/x/y"),
            "No such file or directory (/x/y)",
        ),
        (KeyError("k"), "KeyError: 'k'"),
        (RuntimeError(), "RuntimeError"),
        (NotFound("block abc is not held"), "block abc is not held"),
        (TierUnavailable("S3 put: slow down"), "S3 put: slow down"),
    ],
)
def test_describe(exc: BaseException, said: str) -> None:
    assert describe(exc) == said


def test_json_lines_carry_the_same_fields_as_text() -> None:
    plain = record()
    line = json.loads(JsonFormatter(worker=2).format(plain))
    assert line["level"] == "WARNING" and line["logger"] == "kvstore.storage"
    assert line["message"] == "hello there" and line["worker"] == 2
    assert line["time"].endswith("Z") and "T" in line["time"]
    text = TextFormatter(worker=2).format(plain)
    assert text.endswith("WARNING kvstore.storage [worker 2] hello there")


def test_an_access_line_has_its_fields_by_name() -> None:
    fields = ("GET", "/kvsp/v1/x", 200, 0, 2048, 1.23456, "urn:kvstore:alice", "127.0.0.1")
    access = record(ACCESS_TEXT, fields, access=fields)
    line = json.loads(JsonFormatter().format(access))
    assert line["method"] == "GET" and line["path"] == "/kvsp/v1/x" and line["status"] == 200
    assert (line["octets_in"], line["octets_out"]) == (0, 2048)
    assert line["duration_ms"] == 1.235
    assert line["principal"] == "urn:kvstore:alice" and line["peer"] == "127.0.0.1"
    assert "worker" not in line
    text = TextFormatter().format(access)
    assert (
        "GET /kvsp/v1/x 200 in=0 out=2048 1.2ms principal=urn:kvstore:alice peer=127.0.0.1" in text
    )


def test_an_exception_is_one_json_line() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        failed = record("it failed", ())
        failed.exc_info = sys.exc_info()
    out = JsonFormatter().format(failed)
    assert "\n" not in out
    assert "ValueError: bad" in json.loads(out)["exception"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_one_line_then_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tally = Tally(logging.getLogger("kvstore.test"), "tier %s lost %d block(s)", clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvstore.test"):
        for _ in range(64):
            tally("redis", "redis lost layers 0-7")
        tally("lmdb")
        assert [r.getMessage() for r in caplog.records] == [
            "tier redis lost 1 block(s): redis lost layers 0-7",
            "tier lmdb lost 1 block(s)",
        ]
        clock.now += 11  # the window ended: the next one logs what it held
        tally("redis")
        tally.flush()
    said = [r.getMessage() for r in caplog.records]
    assert said[2:] == ["tier redis lost 63 block(s)", "tier redis lost 1 block(s)"]
    assert tally.counts == {"redis": 65, "lmdb": 1}


async def test_a_burst_s_count_is_logged_when_its_window_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tally = Tally(logging.getLogger("kvstore.test"), "tier %s lost %d block(s)", window_s=0.05)
    with caplog.at_level(logging.WARNING, logger="kvstore.test"):
        for _ in range(5):
            tally("s3")
        assert len(caplog.records) == 1
        for _ in range(100):  # bounded: the timer fires after 50 ms
            if len(caplog.records) == 2:
                break
            await asyncio.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == [
        "tier s3 lost 1 block(s)",
        "tier s3 lost 4 block(s)",
    ]


def test_setup_sends_uvicorn_and_access_lines_through_one_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvstore import logs

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        logs.setup("info", "json", access_log=False)
        logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
        logging.getLogger(ACCESS).info("not written")
        logging.getLogger("kvstore.serve").info("written")
        logging.getLogger("some.library").info("not written either")
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
        assert [(x["logger"], x["message"]) for x in lines] == [
            ("uvicorn.error", "Invalid HTTP request received."),
            ("kvstore.serve", "written"),
        ]
        logs.setup("info", "text", access_log=True)
        logging.getLogger(ACCESS).info("GET / 200")
        assert "INFO kvstore.access GET / 200" in capsys.readouterr().err
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.getLogger(ACCESS).setLevel(logging.NOTSET)
        logging.getLogger("kvstore").setLevel(logging.NOTSET)
