"""Durability on disk: flush a file's or a directory's contents to the device."""

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path (a directory's fsync makes renames in it durable)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
