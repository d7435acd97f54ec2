"""Starting a new instance when none fits (PL3).

The operator's command (``controller.start_command``, run without a shell)
starts an inference instance and prints its base URI on the first line of
its output once the instance takes directives; the PC then places the
request there and sends the prefetch directive at once, so that loading the
cache overlaps the instance's start. One start at a time, and none within
``cooldown_s`` of the last, so that a burst of requests starts one instance,
not a fleet. The command sees ``KVSP_SCOPE_ID``, ``KVSP_COMPAT_ID`` and
``KVSP_REQUEST_REF`` in its environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence

from ..protocol._json import check_uri
from ..protocol.problems import InvalidRecord

log = logging.getLogger("kvstore.controller")


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
        self._lock = asyncio.Lock()
        self._next = 0.0

    async def start(self, scope_id: str, compat_id: str, request_ref: str | None) -> str | None:
        """The new instance's base URI, or None (busy, cooling down, or it failed)."""
        if self._lock.locked() or self.clock() < self._next:
            return None
        async with self._lock:
            self._next = self.clock() + self.cooldown_s
            env = dict(os.environ, KVSP_SCOPE_ID=scope_id, KVSP_COMPAT_ID=compat_id,
                       KVSP_REQUEST_REF=request_ref or "")  # fmt: skip
            try:
                process = await asyncio.create_subprocess_exec(
                    *self.command, env=env, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
            except OSError as exc:
                log.error("start_command %s: %s", self.command[0], exc)
                return None
            try:
                out, err = await asyncio.wait_for(process.communicate(), self.timeout_s)
            except TimeoutError:
                process.kill()
                await process.wait()
                log.error("start_command took longer than %.0f s; killed", self.timeout_s)
                return None
            if process.returncode != 0:
                log.error("start_command exited %s: %s", process.returncode,
                          err.decode(errors="replace")[-500:])  # fmt: skip
                return None
            first = out.decode(errors="replace").strip().splitlines()[:1]
            try:
                uri = check_uri(first[0] if first else "", "start_command output")
            except InvalidRecord as exc:
                log.error("start_command printed no base URI: %s", exc.detail)
                return None
            log.warning("started instance %s (PL3)", uri)
            return uri if uri.endswith("/") else uri + "/"
