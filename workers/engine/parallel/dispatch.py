"""Dispatch and combine: rows exchanged between the ranks of a group, a different number to each.

`exchange_counts` tells every rank how many rows each other rank will send it (an all-to-all of one
count per pair), then `exchange_rows` moves the rows (an all-to-all with those splits). Both join
the collective even with nothing to send, which is how a rank without tokens keeps the others going.
The counts come to the host: a variable-size all-to-all needs its split sizes there.
"""

import torch

from workers.engine.parallel.groups import EPGroup


def exchange_counts(group: EPGroup, send_counts: torch.Tensor) -> torch.Tensor:
    """`send_counts[r]`: rows this rank sends rank r; returns rows it receives from each rank."""
    recv_counts = torch.empty_like(send_counts)
    ones = [1] * group.size
    group.process_group.alltoall_base(recv_counts, send_counts, ones, ones).wait()
    return recv_counts


def exchange_rows(
    group: EPGroup, rows: torch.Tensor, *, send_counts: list[int], recv_counts: list[int]
) -> torch.Tensor:
    """Rows grouped by destination rank (`send_counts` of them for each, in rank order) -> the rows
    the other ranks sent this one, grouped by source rank."""
    received = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    group.process_group.alltoall_base(received, rows.contiguous(), recv_counts, send_counts).wait()
    return received
