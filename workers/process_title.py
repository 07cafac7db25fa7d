"""A process's title: the name ps and top show for it."""


def set_process_title(title: str) -> None:
    """Best effort: only Linux exposes it as a file (/proc/self/comm keeps 15 bytes)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(title[:15])
    except OSError:
        pass
