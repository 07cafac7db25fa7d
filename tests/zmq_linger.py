"""A bounded linger for every ZMQ context a test process makes.

A context the garbage collector finds unclosed is destroyed in whichever thread runs the collection,
and destroying it waits for its sockets' unsent messages: with ZMQ's default linger (forever) and a
peer that is gone, that thread (some later test, at random) blocks for good. A full suite hung so
once, in a sampler test that touches no socket. Every context made here gives its sockets a linger
of LINGER_MS unless the code sets its own.

That was not enough: a suite hung again in a sampler test, the collector's Context.destroy() blocked
in term() with no socket of its own left open, while a CURVE ZAP thread (workers.curve) sat in its
recv. So a context the collector finds is terminated on a thread of its own: the collection goes on,
and a term() that never returns holds only that daemon thread.
"""

import threading

import zmq

LINGER_MS = 1000


def bound_linger() -> None:
    make_context = zmq.Context.__init__

    def make_context_with_bounded_linger(self: zmq.Context, *args, **kwargs) -> None:
        make_context(self, *args, **kwargs)
        self.setsockopt(zmq.LINGER, LINGER_MS)

    zmq.Context.__init__ = make_context_with_bounded_linger
    destroy_when_collected = zmq.Context.__del__

    def destroy_on_a_thread_of_its_own(self: zmq.Context) -> None:
        threading.Thread(target=destroy_when_collected, args=(self,), name="zmq-context-gc", daemon=True).start()

    zmq.Context.__del__ = destroy_on_a_thread_of_its_own
