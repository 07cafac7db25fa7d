"""KV transfer between engine workers: a request's KV, computed by a prefill worker, moved to the decode
worker that continues it (or by a draining decode worker to another).

`frames`: the wire format of a transfer through host memory (raw per-layer frames over ZMQ).
`link`: the two ends, a prefill worker's sender thread and a decode worker's receiver.
"""
