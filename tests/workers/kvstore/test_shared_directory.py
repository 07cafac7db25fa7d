"""Processes that share one store directory, each with its own in-process index (the embedded
default): a block another process wrote is found on the index's miss, read and then indexed; a bad
or absent file is still a miss."""

from pathlib import Path

from workers.kvstore.store import open_store


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def test_a_block_written_by_another_process_is_found_in_the_directory_and_indexed(tmp_path: Path) -> None:
    reader = open_store(tmp_path)  # opened first: its index, rebuilt from the files, is empty
    writer = open_store(tmp_path)
    for i in range(3):
        assert writer.write(key(i), bytes([i]) * 64, depth=i, traffic_class="agent")

    assert reader.match([key(0), key(1), key(2), key(9)]) == 3
    assert [bytes(p) for p in reader.read([key(0), key(1)])] == [bytes([0]) * 64, bytes([1]) * 64]
    entry = reader.index.get(key(2))
    assert (entry.traffic_class, entry.depth) == ("agent", 2)
    assert not reader.write(key(1), b"other", depth=1, traffic_class="chat")  # known now: not written again


def test_a_missing_or_corrupt_file_is_a_miss_and_stops_the_match_there(tmp_path: Path) -> None:
    reader = open_store(tmp_path)
    writer = open_store(tmp_path)
    for i in range(3):
        writer.write(key(i), bytes([i]) * 64, depth=i, traffic_class="chat")
    writer.files.path(key(1)).write_bytes(b"SKVB garbage")

    assert reader.match([key(0), key(1), key(2)]) == 1
    assert reader.index.get(key(1)) is None
