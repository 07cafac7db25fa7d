"""The store's own in-memory index, kept by the GC process (workers.kvstore.gc_process) of a store
without a shared Redis index: built from the block directory, served to the store's other
processes (workers.kvstore.index_server), and reconciled with the directory before each GC run.

Most processes use this index through the server, so it records their writes, hits and cache hints
exactly. The directory is the truth all the same: reconciling adds block files it does not hold
(written by a process with an index of its own, or left behind by a writer killed between its file
and its index entry), records reads that went past it (a reader touches the file's mtime on every
hit, and a block file nobody read has its creation time as mtime: workers.kvstore.block_files), and
drops entries whose file is gone (a reader deletes a corrupt file). What the directory cannot tell:
how many reads went past the index between two runs (they count as one hit), and cache hints given
to an index of another process's own.

Entries reconciled in arrive out of order of last access, which MemoryIndex's expiry query relies
on, so this index finds expired entries by a scan of the class instead (milliseconds per hundred
thousand blocks, once per GC run).
"""

import math

import msgspec

from workers.kvstore.block_files import BlockFiles
from workers.kvstore.index import BlockEntry
from workers.kvstore.memory_index import MemoryIndex

# File times go through the filesystem's timestamps (nanoseconds on ext4, xfs, tmpfs) and back through a
# float: closer than this is the same time. (A filesystem with coarser timestamps blurs a read within
# its resolution of the write into the write.)
SAME_TIME_S = 1e-5


class Reconciliation(msgspec.Struct, frozen=True, kw_only=True):
    added: int  # block files the index did not hold
    accessed: int  # blocks read past the index since it last saw them
    dropped: int  # entries whose file is gone


class DirectoryIndex(MemoryIndex):
    def reconcile(self, files: BlockFiles) -> Reconciliation:
        """Bring the index in line with the block files under `files`, one stat per file (headers are
        read only for files the index does not hold)."""
        found: list[BlockEntry] = []
        accessed = 0
        listed = set()
        for key, _size, mtime in files.listing():
            listed.add(key)
            entry = self.get(key)
            if entry is None:
                header = files.stat(key)
                if header is not None:
                    meta, size, mtime = header
                    read_since = mtime > meta.created_at + SAME_TIME_S
                    found.append(
                        meta.index_entry(key, size, last_access=max(mtime, meta.created_at), hit_count=int(read_since))
                    )
            elif mtime > entry.last_access + SAME_TIME_S:
                self.touch([key], mtime)
                accessed += 1
        added = self.add(sorted(found, key=lambda entry: entry.last_access))
        # An entry the listing missed may have been written after its folder was listed: only an entry
        # whose file is absent now is gone (writers create the file before the entry).
        gone = [entry.key for entry in self.entries() if entry.key not in listed and not files.path(entry.key).exists()]
        dropped = len(self.remove(gone))
        return Reconciliation(added=added, accessed=accessed, dropped=dropped)

    def expired(self, traffic_class: str, cutoff: float, limit: int, *, now: float = math.inf) -> list[BlockEntry]:
        found = [
            entry
            for entry in self.entries()
            if entry.traffic_class == traffic_class and entry.last_access <= cutoff and entry.retain_until <= now
        ]
        found.sort(key=lambda entry: entry.last_access)
        return found[:limit]
