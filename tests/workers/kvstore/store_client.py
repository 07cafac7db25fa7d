"""A process with a store of its own on a shared directory, driven one command at a time from a test:
the other processes around a store GC process (test_gc_process).

    python -m tests.workers.kvstore.store_client DIRECTORY INDEX_URL

Reads one JSON command per line on stdin and answers each with one JSON line on stdout:
{"op": "write", "key": HEX, "depth": D, "class": C, "retain_until": T} → {"size": bytes of its file}
{"op": "read", "keys": [HEX...]} → {"read": blocks read, from the first}
{"op": "match", "keys": [HEX...]} → {"matched": blocks the store says it holds, from the first}
"""

import json
import subprocess
import sys
from pathlib import Path

from workers.kvstore.store import open_store

PAYLOAD_BYTES = 4096


def payload(key: bytes) -> bytes:
    return key * (PAYLOAD_BYTES // len(key))


def main(directory: str, index_url: str) -> None:
    store = open_store(Path(directory), index_url)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        keys = [bytes.fromhex(key) for key in command.get("keys", [])]
        if command["op"] == "write":
            key = bytes.fromhex(command["key"])
            store.write(
                key,
                payload(key),
                depth=command["depth"],
                traffic_class=command["class"],
                retain_until=command["retain_until"],
            )
            answer = {"size": store.files.path(key).stat().st_size}
        elif command["op"] == "read":
            read = store.read(keys)
            assert all(bytes(block) == payload(key) for key, block in zip(keys, read))
            answer = {"read": len(read)}
        elif command["op"] == "match":
            answer = {"matched": store.match(keys)}
        else:
            raise ValueError(f"unknown command {command!r}")
        print(json.dumps(answer), flush=True)


class StoreClient:
    """The test's handle on one store_client process."""

    def __init__(self, directory: Path, index_url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.kvstore.store_client", str(directory), index_url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.process.stdout.readline()) == {"ready": True}

    def _ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the store client exited with {self.process.wait()}"
        return json.loads(line)

    def write(self, key: bytes, depth: int, traffic_class: str = "agent", *, retain_until: float = 0.0) -> int:
        command = {
            "op": "write",
            "key": key.hex(),
            "depth": depth,
            "class": traffic_class,
            "retain_until": retain_until,
        }
        return self._ask(**command)["size"]

    def read(self, keys: list[bytes]) -> int:
        return self._ask(op="read", keys=[key.hex() for key in keys])["read"]

    def match(self, keys: list[bytes]) -> int:
        return self._ask(op="match", keys=[key.hex() for key in keys])["matched"]

    def close(self) -> int:
        self.process.stdin.close()
        return self.process.wait(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
