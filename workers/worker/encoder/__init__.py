"""The encode worker (role "encode"): a vision-language model's vision tower and connector, alone in
a process of its own, serving EncodeRequests (workers.protocol.encode) over ZMQ.

Sockets: a ROUTER (EncodeRequests and control commands in; EncodeDone, GenerateError or ControlAck
back to the peer that sent each), a PUB (heartbeats of role "encode", on their own thread: patches in
flight, patches encoded, embedding-cache lookups, measured patches per second) and one DEALER per
destination, the request ROUTER of the prefill or mixed worker computing a request's prompt, where
each image's embeddings go as an ImageEmbeddingsDelivery and one raw frame. With a registry
endpoint, a thread announces the encoder there.

The parts, one job each: `server` (sockets, the loop and the handler table; `run_encoder` is what
the worker process runs for role encode), `vision` (the vision tower and preprocessing of an Idefics3 /
SmolVLM directory or config), `images` (decoding and checking a request's images), `batching` (the
queue of images and the batches of tiles cut from it), `embedding_cache` (embeddings by content hash,
bounded in bytes), `destinations` (the DEALERs to the workers embeddings go to), `heartbeats`
(registration and load reports). Drain, resume, shutdown and status are the engine worker's
(workers.worker.control).

It is a part of workers.worker rather than a package beside it because it is a role of the same
worker process (`python -m workers.worker --role encode`, `manage.py run_worker --role encode`)
and reuses that process's control, registration and endpoint helpers: beside it, the two packages
would import each other.
"""
