"""Where other workers' SWA state endpoints are, as requests tell a worker: the latest heard wins, and
the least recently heard go past the cap."""

from workers.protocol.messages import SwaHolder
from workers.worker.swa_peers import SwaPeers


def test_the_latest_endpoint_heard_wins_and_the_least_recent_go_past_the_cap():
    peers = SwaPeers(max_peers=2)
    peers.learn([SwaHolder("a", "tcp://h1:1"), SwaHolder("b", "tcp://h2:1")])
    peers.learn([SwaHolder("a", "tcp://h1:2")])  # a restarted on another port
    assert peers.endpoint("a") == "tcp://h1:2"
    peers.learn([SwaHolder("c", "tcp://h3:1")])
    assert (peers.endpoint("a"), peers.endpoint("b"), peers.endpoint("c")) == ("tcp://h1:2", None, "tcp://h3:1")
    assert peers.endpoint("unknown") is None
