"""``local-storage`` tier: LMDB, durable across restarts.

LMDB calls block, so each runs in a worker thread, off the event loop. A read
copies the value out of the memory map once (the map's buffer is only valid
inside its transaction). The map size is fixed by configuration; a full map
is :class:`TierFull`, and so is a write failing on a file system out of room;
any other LMDB error is :class:`TierUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from kvstore.protocol._bytes import BytesLike
from kvstore.storage.errors import TierFull, TierUnavailable
from kvstore.storage.tier import StorageInUse, Tier

T = TypeVar("T")


#: Free room on the file system under which a failed write counts as "disk full".
_SLACK = 1 << 20


def _free_octets(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def _translated(path: str, writing: int = 0) -> Iterator[None]:
    # STYLE 6: lmdb's exceptions stop here.
    try:
        yield
    except lmdb.MapFullError as exc:
        raise TierFull(f"LMDB map at {path} is full: {exc}") from exc
    except lmdb.Error as exc:
        # A file system out of room fails LMDB's commit with ENOSPC, EDQUOT
        # or, from its page writes, EIO: a full tier (507), not a broken one.
        # EIO means "full" only when the file system has no room for the write.
        text = str(exc)
        if any(x in text for x in ("No space left", "Disk quota exceeded")):
            raise TierFull(f"the file system holding LMDB at {path} is full: {exc}") from exc
        free = _free_octets(path) if writing and "Input/output error" in text else None
        if free is not None and free < 2 * writing + _SLACK:
            raise TierFull(
                f"the file system holding LMDB at {path} is full ({free} octets free): {exc}"
            ) from exc
        raise TierUnavailable(f"LMDB at {path}: {exc}", tier="local-storage") from exc


class LmdbTier(Tier):
    kind = "local-storage"
    persistent = True
    deadline_s = 10.0  # a local disk (or a network file system under it)

    def __init__(
        self,
        path: str,
        map_size: int = 1 << 30,
        read_mbit_per_s: float | None = None,
        sync: bool = True,
    ) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.path = path
        self.read_mbit_per_s = read_mbit_per_s
        with _translated(path):
            # sync=True: a put is on disk when it returns (nothing acknowledged is lost).
            self._env = lmdb.open(path, map_size=map_size, sync=sync, max_dbs=0, readahead=False)
        #: The owner lock's file, held (flock) for the process's life once claimed.
        self._owner_fd: int | None = None

    #: The file whose advisory lock says who owns the directory.
    OWNER_FILE = "kvstore.owner"

    async def claim(self, owner: str, ttl_s: float) -> None:
        """An advisory lock on ``<path>/kvstore.owner`` for the process's life
        (the kernel drops it when the process dies, however it dies), the
        holding pid written in it for the refusal."""
        if self._owner_fd is not None:
            return  # held since the first claim: nothing expires
        file = Path(self.path) / self.OWNER_FILE
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TierUnavailable(
                f"LMDB at {self.path}: {file}: {exc.strerror}", tier=self.kind
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StorageInUse(f"{self.path} is in use by {held}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{owner}\n".encode(), 0)
        self._owner_fd = fd

    async def release(self, owner: str) -> None:
        if self._owner_fd is not None:
            os.ftruncate(self._owner_fd, 0)
            os.close(self._owner_fd)  # the lock goes with it
            self._owner_fd = None

    async def _run(self, fn: Callable[[], T], writing: int = 0) -> T:
        def call() -> T:
            with _translated(self.path, writing):
                return fn()

        return await asyncio.to_thread(call)

    async def get(self, key: str) -> BytesLike | None:
        def read() -> bytes | None:
            with self._env.begin(buffers=True) as txn:
                value = txn.get(key.encode())
                return None if value is None else bytes(value)

        return await self._run(read)

    async def put(self, key: str, value: BytesLike) -> None:
        def write() -> None:
            with self._env.begin(write=True) as txn:
                txn.put(key.encode(), value)

        await self._run(write, writing=memoryview(value).nbytes)

    # The batch forms run in one transaction: one thread hop and, with
    # sync=True, one fsync for all of them (a segment and its layer table).

    async def get_many(self, keys: Sequence[str]) -> list[BytesLike | None]:
        wanted = [key.encode() for key in keys]

        def read() -> list[BytesLike | None]:
            with self._env.begin(buffers=True) as txn:
                values = [txn.get(key) for key in wanted]
                return [None if v is None else bytes(v) for v in values]

        return await self._run(read)

    async def put_many(self, items: Iterable[tuple[str, BytesLike]]) -> None:
        pairs = [(key.encode(), value) for key, value in items]

        def write() -> None:
            with self._env.begin(write=True) as txn:
                for key, value in pairs:
                    txn.put(key, value)

        await self._run(write, writing=sum(memoryview(v).nbytes for _, v in pairs))

    async def delete_many(self, keys: Iterable[str]) -> None:
        doomed = [key.encode() for key in keys]

        def remove() -> None:
            with self._env.begin(write=True) as txn:
                for key in doomed:
                    txn.delete(key)

        await self._run(remove)

    async def delete(self, key: str) -> None:
        def remove() -> None:
            with self._env.begin(write=True) as txn:
                txn.delete(key.encode())

        await self._run(remove)

    async def sized_keys(self) -> AsyncIterator[tuple[str, int | None]]:
        def scan() -> list[tuple[str, int | None]]:
            # With buffers, a value is a view of its page: sized, not copied.
            with self._env.begin(buffers=True) as txn:
                return [(bytes(k).decode(), len(v)) for k, v in txn.cursor().iternext()]

        for pair in await self._run(scan):
            yield pair

    async def keys(self) -> AsyncIterator[str]:
        async for key, _ in self.sized_keys():
            yield key

    async def close(self) -> None:
        await self.release("")
        self._env.close()
