"""Shard-per-core holders: ``[server] workers = N`` (docs/workers.md).

One Python process serves one core's worth: TLS, HTTP parsing and digests
share its one thread. With ``workers = N`` (``"auto"``: the cores the
process may use) ``kvstore serve --roles holder`` runs N holder processes,
shared-nothing, under one supervisor:

* worker *i* is a KVSP holder of its own: it listens on ``server.port + i``
  (and ``kvstore-<i>.sock`` for ``server.unix_socket = "kvstore.sock"``)
  and its base URI is ``holder.uri`` with the URI's port plus *i*;
* it has its share of every tier (capacity / N), its own LMDB environment
  (``<path>/worker-<i>``), its own key prefix in Redis (``<prefix>w<i>:``)
  and S3 (``<prefix>w<i>/``), its own leases and lease quotas, and it
  publishes its own replica records at the IS under its own URI;
* every worker answers ``GET {base}shards`` with all N base URIs, so a
  client given one finds the others (:class:`kvstore.holderset.HolderSet`
  spreads PUTs over them by rendezvous hashing);
* ``/readyz`` of each worker says whether *it* is ready, and lists every
  worker's state (starting, up, stopping, down) and restarts as the
  supervisor sees them; its ``/metrics`` carry a ``worker`` label.

The supervisor starts the workers, restarts one that dies (after 0.5 s,
doubling to 30 s while it keeps dying; its LMDB blocks are recovered as at
any start), and at SIGTERM or SIGINT sends every worker SIGTERM, waits for
their stops (each spills and withdraws as a lone holder does) and exits 0
when they all stopped cleanly. A worker that fails its very first start
(a port in use, say) stops the whole set: that is a configuration to fix,
not a crash to retry. The IS, PC and instance roles are not sharded: they
run in processes of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .config import Config, ConfigError, StorageConfig, TierConfig
from .seat import DOWN, STARTING, STOPPING, UP, Board, Seat

log = logging.getLogger("kvstore.workers")

#: The backends' own default key prefixes (a worker's prefix extends it),
#: and what ends a worker's part of it.
DEFAULT_PREFIX = {"redis": "kvstore:", "s3": "kvstore/"}
_SEPARATOR = {"redis": ":", "s3": "/"}
#: Restart delays: the first, the longest, and how long a worker must run
#: before a crash counts as a new one (the delay starts again from the first).
RESTART_FIRST_S, RESTART_MAX_S, RESTART_RESET_S = 0.5, 30.0, 60.0


def worker_uri(uri: str, index: int) -> str:
    """``uri`` with its port plus ``index`` (the URI's default port if it names none)."""
    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return urlunsplit(parts._replace(netloc=f"{host}:{port + index}"))


def worker_socket(path: str, index: int) -> str:
    """Worker ``index``'s unix socket: ``kvstore.sock`` -> ``kvstore-<i>.sock``
    beside it (empty stays empty)."""
    if not path:
        return ""
    given = Path(path)
    return str(given.with_name(f"{given.stem}-{index}{given.suffix}"))


def worker_storage(storage: StorageConfig, index: int, count: int) -> StorageConfig:
    """Worker ``index``'s share of ``storage``: capacity / count of each tier,
    its own LMDB directory, its own Redis and S3 key prefix; a host tier
    knows how many workers share the machine's memory."""
    tiers = []
    for tier in storage.tiers:
        options = dict(tier.options)
        if tier.backend == "lmdb" and isinstance(options.get("path"), str):
            options["path"] = str(Path(options["path"]) / f"worker-{index}")
        elif tier.backend == "host":
            options["workers"] = count  # the prefault guard weighs every worker's arena
        elif tier.backend in DEFAULT_PREFIX:
            prefix = options.get("prefix", DEFAULT_PREFIX[tier.backend])
            options["prefix"] = f"{prefix}w{index}{_SEPARATOR[tier.backend]}"
        tiers.append(TierConfig(tier.backend, max(1, tier.capacity // count), options))
    return dataclasses.replace(storage, tiers=tuple(tiers))


@contextlib.contextmanager
def _hang_ups(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """SIGHUP goes to ``handler`` meanwhile (its default would end the
    supervisor at once, its workers left without it); main thread only."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGHUP, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def worker_config(config: Config, index: int) -> Config:
    """The configuration worker ``index`` of ``config.server.workers`` runs:
    a lone holder (``workers = 1``) on its own port, URI and share of storage,
    knowing every worker's URI (``holder.shards``, for ``GET shards``)."""
    count = config.server.workers
    uris = tuple(worker_uri(config.holder.uri, i) for i in range(count))
    return dataclasses.replace(
        config,
        server=dataclasses.replace(
            config.server,
            port=config.server.port + index,
            workers=1,
            unix_socket=worker_socket(config.server.unix_socket, index),
            proxy_port=config.server.proxy_port + index if config.server.proxy_port else 0,
            health_port=config.server.health_port + index if config.server.health_port else 0,
        ),
        holder=dataclasses.replace(config.holder, uri=uris[index], shards=uris),
        storage=worker_storage(config.storage, index, count),
    )


def _die_with_parent(supervisor: int) -> None:
    """Ask Linux for SIGTERM when the supervisor dies (even by SIGKILL), so
    that no worker outlives it holding its port; if it died already, before
    the request was made, end now."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != supervisor:
        raise SystemExit(0)


def _worker_main(config: Config, index: int, board: Board, supervisor: int) -> None:
    """A worker process: one lone holder, see :func:`worker_config`. In a
    process group of its own: a terminal's Ctrl-C reaches the supervisor
    only, which passes the stop on (a second SIGINT would cut uvicorn's
    wait for in-flight requests short)."""
    os.setpgrp()
    _die_with_parent(supervisor)
    from .serve import run
    from .storage.tier import StorageInUse

    uris = tuple(worker_uri(config.holder.uri, i) for i in range(config.server.workers))
    try:
        run(worker_config(config, index), ("holder",), seat=Seat(index, uris, board))
    except (ConfigError, StorageInUse) as exc:
        # One line, as a lone holder says it (its share's storage in use,
        # its port taken): a configuration to fix.
        print(f"kvstore: error: worker {index}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


class Supervisor:
    """Runs ``config.server.workers`` holder workers until a signal (see the module)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.count = config.server.workers
        self.context = multiprocessing.get_context("spawn")
        self.board = Board(self.count, self.context)
        self.processes: list[Any] = [None] * self.count
        self.started_at = [0.0] * self.count
        self.delay = [RESTART_FIRST_S] * self.count
        self.due = [0.0] * self.count
        self.ever_up = [False] * self.count
        self.stopping: int | None = None  # the signal that began the stop
        self.failed = False
        self.signalled: set[int] = set()

    def _start(self, index: int) -> None:
        self.board.states[index] = STARTING
        process = self.context.Process(
            target=_worker_main,
            args=(self.config, index, self.board, os.getpid()),
            name=f"kvstore-worker-{index}",
            daemon=False,
        )
        process.start()
        self.processes[index] = process
        self.started_at[index] = time.monotonic()
        log.info(
            "worker %d started: pid %d, %s",
            index,
            process.pid,
            worker_uri(self.config.holder.uri, index),
        )

    def _signal(self, sig: int, frame: Any) -> None:
        """The first SIGTERM or SIGINT stops every worker with SIGTERM (their
        graceful stop); a later one is passed on as it came (a second SIGINT:
        uvicorn cuts its wait for in-flight requests short)."""
        if self.stopping is None:
            self.stopping = sig
            log.info("stopping %d workers (signal %d)", self.count, sig)
            self._send(signal.SIGTERM)
        else:
            log.warning("signal %d while stopping: passed on to the workers", sig)
            self._send(sig)

    def _hang_up(self, sig: int, frame: Any) -> None:
        """SIGHUP: every worker reads its certificates and policy again
        (kvstore.reload); the supervisor has none of its own."""
        log.info("reloading the certificates and policies of %d workers (SIGHUP)", self.count)
        for process in self.processes:
            if process is not None and process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)

    def _send(self, sig: int, once: bool = False) -> None:
        """``sig`` to every live worker (``once``: to those not sent one yet)."""
        for process in self.processes:
            if process is None or not process.is_alive():
                continue
            if once and process.pid in self.signalled:
                continue
            self.signalled.add(process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)

    def _reap(self, index: int) -> None:
        """Worker ``index`` has exited: restart it later, or give up the set."""
        process = self.processes[index]
        self.processes[index] = None
        if self.board.states[index] in (UP, STOPPING):
            self.ever_up[index] = True
        self.board.states[index] = DOWN
        ran = time.monotonic() - self.started_at[index]
        if self.stopping is not None:
            return
        if not self.ever_up[index]:
            log.error(
                "worker %d exited with %s during its first start; stopping every worker "
                "(see its log lines above)",
                index,
                process.exitcode,
            )
            self.failed = True
            self._signal(signal.SIGTERM, None)
            return
        if ran >= RESTART_RESET_S:
            self.delay[index] = RESTART_FIRST_S
        self.due[index] = time.monotonic() + self.delay[index]
        log.warning(
            "worker %d (pid %d) exited with %s after %.1f s; restarting in %.1f s",
            index,
            process.pid,
            process.exitcode,
            ran,
            self.delay[index],
        )
        self.delay[index] = min(self.delay[index] * 2, RESTART_MAX_S)

    def run(self) -> int:
        """Supervise until a signal; the exit status (0: every worker stopped cleanly)."""
        from .listener import stop_signals

        with stop_signals(self._signal), _hang_ups(self._hang_up):
            for index in range(self.count):
                self._start(index)
            while self.stopping is None:
                alive = [p.sentinel for p in self.processes if p is not None]
                wait(alive, timeout=0.25)
                now = time.monotonic()
                for index, process in enumerate(self.processes):
                    if process is None:
                        if self.stopping is None and now >= self.due[index]:
                            self.board.restarts[index] += 1
                            self._start(index)
                    elif not process.is_alive():
                        self._reap(index)
            return self._stop()

    def _stop(self) -> int:
        # Each worker's own stop is bounded by shutdown_grace_s; a little
        # more for the process to start and end its interpreter.
        deadline = time.monotonic() + self.config.server.shutdown_grace_s + 10.0
        clean = not self.failed
        # A worker started while the signal came was not in the list yet.
        self._send(signal.SIGTERM, once=True)
        for index, process in enumerate(self.processes):
            if process is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker %d did not stop in time; killed", index)
                process.kill()
                process.join(5)
                clean = False
            elif process.exitcode == -signal.SIGTERM:
                pass  # stopped before it had its handlers: it was still starting
            elif process.exitcode != 0:
                log.warning("worker %d stopped with exit status %s", index, process.exitcode)
                clean = False
            self.board.states[index] = DOWN
        log.info("all %d workers stopped", self.count)
        return 0 if clean else 1


def supervise(config: Config, roles: tuple[str, ...] = ("holder",)) -> int:
    """Run the holder workers of ``config`` (``server.workers`` > 1) until a
    signal; the configuration is checked first, as ``serve`` does."""
    from .config import check

    problems = check(config, roles)
    if problems:
        raise ConfigError(problems[0])
    return Supervisor(config).run()
