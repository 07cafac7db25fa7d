"""The gateway's EngineClient starts with the cluster's CURVE key from SLUICE_CURVE_KEY_FILE: a bad
file, or a worker on the network without a key, fails the start with one line naming what to fix."""

import asyncio

import pytest
import zmq

from controlplane.gateway.engine import close_engine_client, engine_client
from workers import curve
from workers.curve import CurveError


def start_client() -> None:
    async def go():
        try:
            await engine_client()
        finally:
            await close_engine_client()

    asyncio.run(go())


def test_a_key_file_that_does_not_parse_fails_the_start_naming_the_file(settings, tmp_path):
    settings.SLUICE_CURVE_KEY_FILE = str(tmp_path / "cluster.key")
    (tmp_path / "cluster.key").write_bytes(b"garbage \xff")

    with pytest.raises(CurveError, match=f"{tmp_path}/cluster.key: not text"):
        start_client()


def test_a_worker_on_the_network_without_a_key_fails_the_start_saying_how_to_get_keys(settings):
    settings.SLUICE_CURVE_KEY_FILE = ""
    settings.SLUICE_WORKER_ENDPOINTS = [("tcp://10.0.0.1:7100", "tcp://10.0.0.1:7101")]

    with pytest.raises(CurveError, match="refusing tcp://10.0.0.1:7100 .*create_data_plane_key"):
        start_client()


def test_with_the_key_file_a_worker_on_the_network_is_followed(settings, tmp_path):
    curve.write_key_file(tmp_path / "cluster.key", curve.generate_key(1))
    settings.SLUICE_CURVE_KEY_FILE = str(tmp_path / "cluster.key")
    settings.SLUICE_WORKER_ENDPOINTS = [("tcp://10.0.0.1:7100", "tcp://10.0.0.1:7101")]

    async def go():
        try:
            client = await engine_client()
            return [link.dealer.mechanism for link in client._links]
        finally:
            await close_engine_client()

    assert asyncio.run(go()) == [zmq.CURVE]
