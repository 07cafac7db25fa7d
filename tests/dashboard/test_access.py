"""Only operators, admins and auditors see the dashboard, its Dash endpoints and its live feed."""

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels.testing.websocket import WebsocketCommunicator
from django.test import Client

from controlplane.asgi import application
from dashboard.telemetry_app import APP_NAME

DASH_ROOT = f"/django_plotly_dash/app/{APP_NAME}/"
SOCKET_PATH = "/ws/telemetry/"


def _socket(client: Client | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://testserver")]
    if client is not None:
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return WebsocketCommunicator(application, SOCKET_PATH, headers=headers)


@pytest.mark.django_db
def test_anonymous_users_are_sent_to_the_login_page(client):
    response = client.get("/dashboard/")

    assert response.status_code == 302
    assert response["Location"] == "/accounts/login/?next=/dashboard/"
    assert client.get("/accounts/login/").status_code == 200


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["tenant", None])
def test_users_without_a_viewer_role_are_refused(client_as, role):
    client = client_as(role)

    assert client.get("/dashboard/").status_code == 403
    assert client.get(DASH_ROOT).status_code == 403
    assert client.get(f"{DASH_ROOT}_dash-layout").status_code == 403


@pytest.mark.django_db
def test_anonymous_users_cannot_reach_the_dash_endpoints(client):
    assert client.get(DASH_ROOT).status_code == 302
    assert client.post(f"{DASH_ROOT}_dash-update-component", {}, content_type="application/json").status_code == 302


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["operator", "admin", "auditor"])
def test_viewers_get_the_page_with_the_dash_app(client_as, role):
    client = client_as(role)

    page = client.get("/dashboard/")
    app = client.get(DASH_ROOT)

    assert page.status_code == 200
    assert f'src="{DASH_ROOT}"' in page.content.decode()
    assert app.status_code == 200
    assert 'id="_dash-config"' in app.content.decode()


@pytest.mark.django_db
def test_operators_sign_in_and_land_on_the_dashboard(make_user):
    make_user("operator", username="olga", password="secret-pw")
    client = Client()

    response = client.post("/accounts/login/", {"username": "olga", "password": "secret-pw", "next": "/dashboard/"})

    assert response.status_code == 302
    assert response["Location"] == "/dashboard/"
    assert client.get("/dashboard/").status_code == 200


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role", ["anonymous", "tenant", None])
def test_the_websocket_refuses_anonymous_and_tenant_users(client_as, role):
    client = None if role == "anonymous" else client_as(role)

    async def connect() -> bool:
        connected, _ = await _socket(client).connect()
        return connected

    assert async_to_sync(connect)() is False


@pytest.mark.django_db(transaction=True)
def test_the_websocket_forwards_telemetry_group_messages_to_operators(client_as):
    client = client_as("operator")
    snapshot = {"at": "2026-11-30T12:00:00+00:00", "workers": [], "cache_hit_rate": 0.5}

    async def receive_one() -> dict:
        communicator = _socket(client)
        connected, _ = await communicator.connect()
        assert connected
        await get_channel_layer().group_send("telemetry", {"type": "telemetry.update", "snapshot": snapshot})
        message = await communicator.receive_json_from(timeout=10)
        await communicator.disconnect()
        return message

    assert async_to_sync(receive_one)() == {"snapshot": snapshot}


@pytest.mark.django_db(transaction=True)
def test_the_websocket_refuses_pages_from_other_sites(client_as):
    client = client_as("operator")

    async def connect() -> bool:
        communicator = WebsocketCommunicator(
            application,
            SOCKET_PATH,
            headers=[
                (b"origin", b"http://evil.example"),
                (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
            ],
        )
        connected, _ = await communicator.connect()
        return connected

    assert async_to_sync(connect)() is False
