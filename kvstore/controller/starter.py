"""Starting a new instance when none fits (PL3).

The operator's command (``controller.start_command``, run without a shell)
starts an inference instance and prints its base URI on the first line of
its output once the instance takes directives; it may keep running (it may
be the instance). The PC then places the request there and sends the
prefetch directive at once, so that loading the cache overlaps the
instance's start. One start at a time: placements that arrive during a start
wait for it and go to the same instance, and so do those within
``cooldown_s`` after it, so that a burst of requests starts one instance,
not a fleet. The command sees ``KVSP_SCOPE_ID``, ``KVSP_COMPAT_ID`` and
``KVSP_REQUEST_REF`` in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

log = logging.getLogger("kvstore.controller")


def _base_uri(line: str) -> str | None:
    parts = urlsplit(line.strip())
    if parts.scheme not in ("https", "http") or not parts.netloc or parts.query or parts.fragment:
        return None
    return line.strip()


class InstanceStarter:
    def __init__(
        self,
        command: Sequence[str],
        *,
        timeout_s: float = 60.0,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = list(command)
        self.timeout_s, self.cooldown_s, self.clock = timeout_s, cooldown_s, clock
        self._starting: asyncio.Task[str | None] | None = None
        self._last: str | None = None
        self._until = 0.0  # the last start counts until then
        self._children: set[asyncio.Task[None]] = set()
        self._processes: set[asyncio.subprocess.Process] = set()
        #: Instances started (OPS1).
        self.launched = 0

    async def start(self, scope_id: str, compat_id: str, request_ref: str | None) -> str | None:
        """The new instance's base URI, or None (it failed, or failed lately)."""
        if self._starting is not None:
            return await asyncio.shield(self._starting)  # one start for a burst
        if self.clock() < self._until:
            return self._last
        self._starting = asyncio.create_task(self._launch(scope_id, compat_id, request_ref))
        try:
            uri = await asyncio.shield(self._starting)
        finally:
            self._starting = None
        return uri

    async def _launch(self, scope_id: str, compat_id: str, request_ref: str | None) -> str | None:
        uri = None
        try:
            uri = await self._run(scope_id, compat_id, request_ref)
            self.launched += uri is not None
        finally:
            self._last = uri
            self._until = self.clock() + self.cooldown_s  # from the end of the start
        return uri

    async def _run(self, scope_id: str, compat_id: str, request_ref: str | None) -> str | None:
        env = dict(os.environ, KVSP_SCOPE_ID=scope_id, KVSP_COMPAT_ID=compat_id)
        if request_ref is not None and request_ref.isascii() and request_ref.isprintable():
            env["KVSP_REQUEST_REF"] = request_ref  # (opaque: only what an environment holds)
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except (OSError, ValueError) as exc:
            log.error("start_command %s: %s", self.command[0], exc)
            return None
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), self.timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            log.error("start_command printed no URI within %.0f s; killed", self.timeout_s)
            return None
        # The command may go on running: read what else it says, and reap it.
        self._processes.add(process)
        child = asyncio.create_task(self._drain(process))
        self._children.add(child)
        child.add_done_callback(self._children.discard)
        uri = _base_uri(line.decode(errors="replace"))
        if uri is None:
            log.error("start_command printed %r, not an http(s) base URI", line[:200])
            return None
        log.info("started instance %s (PL3)", uri)
        return uri

    async def _drain(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        with contextlib.suppress(Exception):
            while await process.stdout.read(1 << 16):
                pass
        code = await process.wait()
        self._processes.discard(process)
        if code:
            log.warning("start_command exited %s", code)

    async def close(self, kill: bool = False) -> None:
        """Stop watching the commands still running (``kill``: end them too)."""
        for process in list(self._processes):
            if kill and process.returncode is None:
                process.kill()
        for child in list(self._children):
            if kill:
                await child
            else:
                child.cancel()
