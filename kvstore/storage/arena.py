"""A memory arena for the host tier: one anonymous mapping, carved into extents.

Why: a block kept in process memory must sit in pages the kernel has handed
the process. Fresh pages fault in one by one on first touch, and on this kind
of machine (a VM) that costs far more than the copy: joining a 2 MiB body into
new memory takes about 1.65 ms, copying it into memory already touched
0.25-0.3 ms (docs/holder.md, "Where a PUT's time goes"). An arena maps the
tier's memory once (pre-faulted with ``MAP_POPULATE`` when ``prefault`` is
set) and reuses it: an extent given back is faulted in already, so a PUT into
a full, evicting cache never waits on the kernel.

Lifetime is by reference, not by call: :meth:`Arena.alloc` returns a writable
byte :class:`memoryview` whose exporter is an extent object; the extent goes
back to the free list only when the last view of it (a slice streamed by a
GET, a hashing thread's view) is gone. So a block deleted or evicted while a
GET still streams it is never overwritten under that GET (there is no
explicit free to get wrong). The callback can run in any thread that drops
the last view, and at any moment (a garbage collection inside :meth:`alloc`
itself): it only appends to a queue, taken into the free list under the
arena's lock by the next call that needs it.

Extents are aligned to :data:`ALIGN` octets and found best fit; neighbours
coalesce when freed. When nothing fits, :meth:`alloc` returns None and the
caller keeps its octets in ordinary memory instead (slower, never wrong).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import sys
import threading
import weakref

#: Extent alignment: a cache line, so a small block wastes little.
ALIGN = 64
#: Linux's value; Python's mmap module names it only from 3.13.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


class Arena:
    """``size`` octets of anonymous memory handed out as extents."""

    def __init__(self, size: int, prefault: bool = False) -> None:
        if size <= 0:
            raise ValueError("an arena needs a positive size")
        self.size = size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        populate = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere touched below
        if prefault and populate:
            flags |= populate
        elif not prefault:
            # Pages come on first touch: no commitment for the untouched rest.
            flags |= _MAP_NORESERVE
        self._map = mmap.mmap(-1, size, flags=flags)
        if prefault and not populate:
            view = memoryview(self._map)
            for offset in range(0, size, mmap.PAGESIZE):
                view[offset] = 0
            view.release()
        self._lock = threading.Lock()
        # Free extents three ways: by start (size), by end (start) to
        # coalesce, and by size (starts) with the sizes sorted for best fit.
        self._free_at: dict[int, int] = {0: size}
        self._free_end: dict[int, int] = {size: 0}
        self._by_size: dict[int, set[int]] = {size: {0}}
        self._sizes: list[int] = [size]
        self._extents: weakref.WeakValueDictionary[int, ctypes.Array[ctypes.c_char]] = (
            weakref.WeakValueDictionary()
        )
        #: Extents given back and not yet in the free list (deque.append is atomic).
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._used = 0

    # --- public ---------------------------------------------------------

    def alloc(self, n: int) -> memoryview | None:
        """A writable view of ``n`` octets of the arena, or None when no free
        extent is that large. Its memory returns when the view and every view
        made from it are gone."""
        if n <= 0:
            return None
        want = -(-n // ALIGN) * ALIGN
        with self._lock:
            self._take_returned()
            i = bisect.bisect_left(self._sizes, want)
            if i == len(self._sizes):
                return None
            have = self._sizes[i]
            start = next(iter(self._by_size[have]))
            self._unlink(start, have)
            if have > want:
                self._link(start + want, have - want)
            self._used += want
        extent = (ctypes.c_char * n).from_buffer(self._map, start)
        weakref.finalize(extent, self._give_back, start, want)
        self._extents[id(extent)] = extent
        return memoryview(extent).cast("B")

    def owns(self, view: memoryview) -> bool:
        """True when ``view`` is the whole of an extent of this arena (as
        :meth:`alloc` returned it), so a tier may keep it without a copy."""
        obj = getattr(view, "obj", None)
        if obj is None:
            return False
        extent = self._extents.get(id(obj))
        if extent is None or extent is not obj:
            return False
        return view.nbytes == ctypes.sizeof(extent) and view.c_contiguous

    @property
    def used(self) -> int:
        """Octets in extents (a view of them may still be held)."""
        with self._lock:
            self._take_returned()
            return self._used

    @property
    def free(self) -> int:
        """Octets not in any extent (some may be too fragmented to use)."""
        return self.size - self.used

    @property
    def largest_free(self) -> int:
        with self._lock:
            self._take_returned()
            return self._sizes[-1] if self._sizes else 0

    # --- free list ------------------------------------------------------

    def _give_back(self, start: int, size: int) -> None:
        # No lock here: this may run inside alloc() on the same thread.
        self._returned.append((start, size))

    def _take_returned(self) -> None:
        """Merge the extents given back into the free list (lock held)."""
        while self._returned:
            start, size = self._returned.popleft()
            self._used -= size
            before = self._free_end.get(start)
            if before is not None:  # coalesce with the free extent ending here
                self._unlink(before, start - before)
                size += start - before
                start = before
            after = self._free_at.get(start + size)
            if after is not None:  # ...and with the one starting where this ends
                self._unlink(start + size, after)
                size += after
            self._link(start, size)

    def _link(self, start: int, size: int) -> None:
        self._free_at[start] = size
        self._free_end[start + size] = start
        starts = self._by_size.get(size)
        if starts is None:
            self._by_size[size] = {start}
            bisect.insort(self._sizes, size)
        else:
            starts.add(start)

    def _unlink(self, start: int, size: int) -> None:
        del self._free_at[start]
        del self._free_end[start + size]
        starts = self._by_size[size]
        starts.discard(start)
        if not starts:
            del self._by_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
