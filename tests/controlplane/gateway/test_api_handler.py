"""API paths skip the browser middleware; the admin keeps it."""

import pytest

from controlplane.gateway.api_handler import is_api_path


def test_api_paths_are_served_without_the_browser_middleware(api, no_workers) -> None:
    response = api.request("GET", "/healthz")
    assert response.status_code == 503  # no workers: the view itself answered
    assert "x-frame-options" not in response.headers and "set-cookie" not in response.headers


def test_the_admin_keeps_its_middleware(api) -> None:
    response = api.request("GET", "/admin/login/")
    assert response.status_code == 200
    # SAMEORIGIN, not DENY: the dashboard embeds its Dash apps in frames of our own pages.
    assert response.headers["x-frame-options"] == "SAMEORIGIN"
    assert "csrftoken" in response.headers["set-cookie"]


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/v1/chat/completions", True), ("/healthz", True), ("/admin/", False), ("/v1", False), ("/", False)],
)
def test_which_paths_are_api_paths(path: str, expected: bool) -> None:
    assert is_api_path(path) is expected
