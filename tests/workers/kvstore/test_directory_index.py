"""The GC process's own index of a directory: reconciled with the block files (files it did not hold
added, reads that went past it counted from the files' mtimes, entries of deleted files dropped), and
expiry that finds what expired whatever order the entries came in."""

import os
import time
from hashlib import blake2b
from pathlib import Path

from workers.kvstore.block_files import BlockFiles, BlockMeta
from workers.kvstore.directory_index import DirectoryIndex, Reconciliation
from workers.kvstore.store import open_store


def key(i: int) -> bytes:
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def test_reconcile_adds_files_counts_reads_past_it_and_drops_deleted_ones(tmp_path: Path) -> None:
    # given blocks written by a process with an index of its own, one of them read already
    other = open_store(tmp_path)
    for i in range(4):
        other.write(key(i), bytes([i]) * 100, depth=i, traffic_class="chat")
    assert len(other.read([key(0)])) == 1
    index = DirectoryIndex()
    files = BlockFiles(tmp_path)

    # when the index first meets the directory
    assert index.reconcile(files) == Reconciliation(added=4, accessed=0, dropped=0)

    # then every block is there, the one read with a hit and its read as last access
    entries = {entry.key: entry for entry in index.entries()}
    assert [entries[key(i)].hit_count for i in range(4)] == [1, 0, 0, 0]
    assert entries[key(0)].last_access > entries[key(0)].created_at
    assert all(entries[key(i)].last_access == entries[key(i)].created_at for i in range(1, 4))

    # when the other process reads another block, one file is deleted and a new one written
    read_at = time.time() + 5
    other.clock = lambda: read_at
    assert len(other.read([key(2)])) == 1
    files.delete([key(3)])
    other.write(key(9), b"new", depth=0, traffic_class="agent")

    # then the next reconcile sees all three
    assert index.reconcile(files) == Reconciliation(added=1, accessed=1, dropped=1)
    assert index.get(key(2)).last_access == read_at and index.get(key(2)).hit_count == 1
    assert index.get(key(3)) is None
    assert index.get(key(9)).traffic_class == "agent"
    assert index.reconcile(files) == Reconciliation(added=0, accessed=0, dropped=0)


def test_an_entry_whose_file_the_listing_missed_is_kept_while_its_file_is_there(tmp_path: Path) -> None:
    # given an entry added through the index (as a served writer does) whose file the directory has
    files = BlockFiles(tmp_path)
    index = DirectoryIndex()
    store = open_store(tmp_path)
    store.index = index
    store.write(key(1), b"x" * 10, depth=0, traffic_class="chat")

    # when a reconcile's listing misses it (written after its folder was listed) and checks it
    listed = list(files.listing())
    files.listing = lambda: iter(())  # the listing of a directory that was empty a moment before
    reconciled = index.reconcile(files)

    # then it stays: only an entry whose file is absent is dropped
    assert listed and reconciled.dropped == 0
    assert index.get(key(1)) is not None


def test_expiry_finds_entries_that_came_in_out_of_order(tmp_path: Path) -> None:
    # given a fresh entry, then an old file found by a reconcile after it (MemoryIndex's order breaks)
    index = DirectoryIndex()
    files = BlockFiles(tmp_path)
    now = time.time()
    store = open_store(tmp_path)
    store.index = index
    store.clock = lambda: now
    store.write(key(1), b"fresh", depth=0, traffic_class="chat")
    files.write(key(2), b"old", BlockMeta(traffic_class="chat", depth=0, created_at=now - 3600))
    os.utime(files.path(key(2)), (now - 3600, now - 3600))
    index.reconcile(files)

    # when the GC asks for what expired more than a minute ago
    expired = index.expired("chat", now - 60, 10)

    # then the old entry is found behind the fresh one
    assert [entry.key for entry in expired] == [key(2)]


def test_reconcile_keeps_the_retention_hint_and_chain_a_block_was_written_under(tmp_path: Path) -> None:
    # given a hinted block of a new chain and an unhinted one, written by a process with an index of its own
    other = open_store(tmp_path)
    other.write(key(1), b"x" * 100, depth=0, traffic_class="chat", retain_until=time.time() + 3600, new_chain=True)
    other.write(key(2), b"y" * 100, depth=1, traffic_class="chat")
    index = DirectoryIndex()

    # when the store's GC index meets the directory
    index.reconcile(BlockFiles(tmp_path))

    # then the hinted block is retained there too, so the GC spares it, and each keeps its chain's kind
    assert index.get(key(1)).retain_until == other.index.get(key(1)).retain_until > 0
    assert index.get(key(2)).retain_until == 0.0
    assert (index.get(key(1)).new_chain, index.get(key(2)).new_chain) == (True, False)
