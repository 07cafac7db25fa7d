import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings import _worker_endpoints


def test_worker_endpoints_are_request_heartbeat_pairs():
    value = "ipc:///run/w0.req|ipc:///run/w0.hb, tcp://10.0.0.2:7100|tcp://10.0.0.2:7101,"

    assert _worker_endpoints(value) == [
        ("ipc:///run/w0.req", "ipc:///run/w0.hb"),
        ("tcp://10.0.0.2:7100", "tcp://10.0.0.2:7101"),
    ]
    assert _worker_endpoints("") == []


@pytest.mark.parametrize("value", ["tcp://a:1", "tcp://a:1|", "|tcp://a:2", "a|b|c"])
def test_malformed_worker_endpoints_are_refused(value):
    with pytest.raises(ImproperlyConfigured):
        _worker_endpoints(value)
