"""Checkpoint files beside the block files, as far as the store's GC needs to know them: where decode
workers keep their requests' checkpoints with the in-process index (workers.worker.checkpoints), and
which of them no request can resume from any more. Torch-free, so that the GC process does not load
the engine.

A decode worker rewrites a request's checkpoint whenever the request's tokens fill another store
block and deletes it when the request ends there; a dead worker's requests are resumed within
seconds of its death. So a checkpoint not written for CHECKPOINT_TTL_S belongs to a request whose
worker died and that no one resumed: the GC deletes it, as Redis expires the checkpoints it holds
after the same time without a write.
"""

import os
import time
from pathlib import Path

FOLDER = "checkpoints"
SUFFIX = ".ckpt"
# A checkpoint outlives its last write this long (in Redis: its expiry, refreshed by every write).
CHECKPOINT_TTL_S = 3600
# A temp file younger than this may be a checkpoint being written (checkpoints are small).
TEMP_GRACE_S = 60


def remove_stale_checkpoints(store_root: Path, *, now: float | None = None, max_age_s: float = CHECKPOINT_TTL_S) -> int:
    """Delete the checkpoint files under `store_root` not written for `max_age_s` seconds, and the
    temp files that killed writers left; returns how many files were deleted."""
    now = time.time() if now is None else now
    removed = 0
    try:
        with os.scandir(Path(store_root) / FOLDER) as found:
            entries = [entry for entry in found if entry.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.endswith(SUFFIX):
            cutoff = now - max_age_s
        elif entry.name.startswith(".") and entry.name.endswith(".tmp"):
            cutoff = now - TEMP_GRACE_S
        else:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime <= cutoff:
                os.unlink(entry.path)
                removed += 1
        except FileNotFoundError:
            pass  # its request ended, or another process swept it, meanwhile
    return removed
