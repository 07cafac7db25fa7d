"""Process groups of an expert-parallel engine: gloo on the CPU, NCCL on CUDA, met at a TCP store on
localhost that rank 0 hosts on a port the system picks.

Rank 0 opens the rendezvous (`Rendezvous.open`), hands its port to the other ranks (the EP engine
sends it down each rank's pipe), and every rank, rank 0 included, joins with `join_group`. After a
rank dies the survivors destroy their group and meet again at a new rendezvous.

Collectives are called on the process group object itself (`alltoall_base`), which torch.distributed's
module-level functions do not accept for a group made outside init_process_group.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = "127.0.0.1"
# Longest a collective waits for a peer. A dead peer's closed sockets fail a gloo collective at
# once; this bounds the wait for one that hangs without dying.
GROUP_TIMEOUT = timedelta(seconds=60)


@dataclass(slots=True)
class Rendezvous:
    """Rank 0's end of a rendezvous: the store the group meets at, kept open while the group lives."""

    store: dist.TCPStore
    world_size: int

    @classmethod
    def open(cls, world_size: int) -> "Rendezvous":
        store = dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        return cls(store=store, world_size=world_size)

    @property
    def port(self) -> int:
        return self.store.port


@dataclass(slots=True)
class EPGroup:
    """One rank's membership of an expert-parallel group. The process group is made directly, not
    as torch.distributed's default group: a process may hold several at once (tests run engines of
    different sizes side by side), and a re-formed group simply replaces a destroyed one."""

    rank: int
    size: int
    device: torch.device
    process_group: dist.ProcessGroup | None  # None for a group of one on the CPU: nothing to exchange
    store: dist.Store | None = None  # kept for the group's life

    def destroy(self) -> None:
        if self.process_group is not None:
            self.process_group.shutdown()
            self.process_group = None
            self.store = None


def join_group(
    *, rank: int, size: int, port: int, device: torch.device, rendezvous: Rendezvous | None = None
) -> EPGroup:
    """Join the group meeting at `port` as `rank` of `size`; rank 0 passes the rendezvous it opened.

    A group of one on the CPU needs no process group; on CUDA one is formed anyway, so the NCCL
    path runs on a single GPU too.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    if (rank == 0) != (rendezvous is not None):
        raise ValueError("rank 0, and only rank 0, hosts the rendezvous")
    if device.type == "cuda" and device.index is None:
        # NCCL binds the process to one GPU, and torch.cuda.set_device wants its index.
        device = torch.device("cuda", torch.cuda.current_device())
    if size == 1 and device.type != "cuda":
        return EPGroup(rank=0, size=1, device=device, process_group=None)
    store = rendezvous.store if rendezvous is not None else dist.TCPStore(HOST, port, size, timeout=GROUP_TIMEOUT)
    prefixed = dist.PrefixStore("ep", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, GROUP_TIMEOUT)
    return EPGroup(rank=rank, size=size, device=device, process_group=group, store=store)
