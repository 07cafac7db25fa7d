"""The data plane's CURVE keypair in the control plane: versions created (and rotated) by the service,
audited without the secret, exported to a key file by the management command, and read back by the
processes that use it (the registry refuses to start on a bad one)."""

import os
import stat

import pytest
from django.core.management import CommandError, call_command

from controlplane.topology.models import DataPlaneKey, ScalingAction, ScalingEvent
from controlplane.topology.services import data_plane_key_create
from workers.curve import load_key_file

pytestmark = pytest.mark.django_db


def events(action: str) -> list[ScalingEvent]:
    return list(ScalingEvent.objects.filter(action=action).order_by("id"))


def test_each_creation_is_a_new_version_audited_without_its_secret():
    first = data_plane_key_create()
    rotated = data_plane_key_create()

    assert (first.version, rotated.version) == (1, 2)
    assert first.public_key != rotated.public_key and first.secret_key != rotated.secret_key
    created = events(ScalingAction.DATA_PLANE_KEY_CREATED)
    assert [(e.actor_label, e.before, e.after["version"]) for e in created] == [
        ("system", {"version": None}, 1),
        ("system", {"version": 1}, 2),
    ]
    assert created[1].after["public_key"] == rotated.public_key
    for event in ScalingEvent.objects.all():
        assert first.secret_key not in str(event.__dict__) and rotated.secret_key not in str(event.__dict__)


def test_export_writes_the_latest_version_mode_0600_and_records_where(tmp_path):
    data_plane_key_create()
    latest = data_plane_key_create()
    path = tmp_path / "cluster.key"

    call_command("export_data_plane_key", str(path))

    key = load_key_file(path)
    assert (key.version, key.public_key.decode(), key.secret_key.decode()) == (2, latest.public_key, latest.secret_key)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    [exported] = events(ScalingAction.DATA_PLANE_KEY_EXPORTED)
    assert exported.after["version"] == 2 and exported.after["destination"].endswith(str(path))


def test_export_of_a_named_version_replaces_a_file_only_when_asked(tmp_path):
    first = data_plane_key_create()
    data_plane_key_create()
    path = tmp_path / "cluster.key"
    call_command("export_data_plane_key", str(path))

    with pytest.raises(CommandError, match="exists; pass --overwrite"):
        call_command("export_data_plane_key", str(path), "--key-version=1")
    kept = load_key_file(path).version
    call_command("export_data_plane_key", str(path), "--key-version=1", "--overwrite")

    assert kept == 2
    assert load_key_file(path).public_key.decode() == first.public_key
    assert [e.after["version"] for e in events(ScalingAction.DATA_PLANE_KEY_EXPORTED)] == [2, 1]  # none refused


def test_export_without_a_key_says_how_to_make_one_unless_asked_to_create_it(tmp_path):
    with pytest.raises(CommandError, match="no data-plane key exists yet: create one"):
        call_command("export_data_plane_key", str(tmp_path / "a.key"))
    with pytest.raises(CommandError, match="no data-plane key version 3"):
        call_command("export_data_plane_key", str(tmp_path / "a.key"), "--key-version=3")

    call_command("export_data_plane_key", str(tmp_path / "a.key"), "--create-if-none")
    call_command("export_data_plane_key", str(tmp_path / "b.key"), "--create-if-none")

    assert list(DataPlaneKey.objects.values_list("version", flat=True)) == [1]
    assert load_key_file(tmp_path / "a.key") == load_key_file(tmp_path / "b.key")
    assert not (tmp_path / "a.key.tmp").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.key", "b.key"]


def test_create_data_plane_key_rotates(capsys):
    call_command("create_data_plane_key")
    call_command("create_data_plane_key")

    assert "version 2 created" in capsys.readouterr().out
    assert list(DataPlaneKey.objects.values_list("version", flat=True)) == [2, 1]


def test_the_registry_refuses_to_start_on_a_bad_key_file_or_a_network_endpoint_without_a_key(tmp_path, settings):
    settings.SLUICE_CURVE_KEY_FILE = str(tmp_path / "truncated.key")
    (tmp_path / "truncated.key").write_text('curve\n    public-key = "abc')

    with pytest.raises(CommandError, match=f"{tmp_path}/truncated.key: no public-key line"):
        call_command("run_registry", "--endpoint=tcp://127.0.0.1:0")
    settings.SLUICE_CURVE_KEY_FILE = ""
    with pytest.raises(CommandError, match="refusing tcp://\\*:7000 without the cluster's CURVE key"):
        call_command("run_registry", "--endpoint=tcp://*:7000")
