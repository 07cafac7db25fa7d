"""An engine worker process: serves GenerateRequests over ZMQ and publishes heartbeats.

Sockets: a ROUTER (requests and control commands in; each request's outputs and each command's
ControlAck go back to the peer that sent it) and a PUB (heartbeats, sent by their own thread). While
the engine has work, the loop checks its sockets without blocking between steps; when idle it blocks
on them for up to a heartbeat interval. With a registry endpoint, a thread announces the worker there.

Roles: a "mixed" worker runs whole requests. A "prefill" worker runs a request that names a
`decode_endpoint` up to its first token, then sends the KV there on its sender thread (as frames,
or as an offer of its pages to a worker of the same host) and releases the pages once the KV is
there (workers.transfer). A "decode" worker also binds a ROUTER, its transfer endpoint: it continues
the requests whose KV arrives there, streaming their outputs to the peer that sent the
ExpectTransferRequest. Either role still runs a plain GenerateRequest whole, so a pool that
has lost all of its other half keeps serving. A mixed or prefill worker also takes the embeddings of
a request's images from encode workers on its ROUTER (ImageEmbeddingsDelivery and a raw frame), and
holds a request with images until they are all there. An "encode" worker runs a vision-language model's vision
tower alone and sends images' embeddings to the worker computing their prompt (workers.worker.encoder).

The parts, one job each: `process` (the entry point: title, parent death, crash report), `server`
(sockets, the loop and the handler table), `transfers` (the disaggregation side: KV sent after
prefill, KV expected and taken in for decode), `image_inbox` (requests waiting for their images'
embeddings, and embeddings that came first), `heartbeats` (load reports and the registration),
`control` (drain state and control commands), `swa_holder` (a sliding-window model's SWA state: kept,
registered in the holder index, served to and fetched from other workers, whose endpoints `swa_peers`
learns from requests), `args` (WorkerArgs and its flags).

Run it with `workers.worker.process.run_worker_process(WorkerArgs(...))` or
`python -m workers.worker --model ...`. The package itself imports nothing, so the control plane can
read the worker's settings (`args`) without loading torch.
"""
