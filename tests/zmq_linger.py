"""A bounded linger for every ZMQ context a test process makes.

A context the garbage collector finds unclosed is destroyed in whichever thread runs the collection,
and destroying it waits for its sockets' unsent messages: with ZMQ's default linger (forever) and a
peer that is gone, that thread (some later test, at random) blocks for good. A full suite hung so
once, in a sampler test that touches no socket. Every context made here gives its sockets a linger
of LINGER_MS unless the code sets its own.
"""

import zmq

LINGER_MS = 1000


def bound_linger() -> None:
    make_context = zmq.Context.__init__

    def make_context_with_bounded_linger(self: zmq.Context, *args, **kwargs) -> None:
        make_context(self, *args, **kwargs)
        self.setsockopt(zmq.LINGER, LINGER_MS)

    zmq.Context.__init__ = make_context_with_bounded_linger
