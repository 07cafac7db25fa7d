"""Shared by the API tests."""

PASSWORD = "correct horse battery staple"


def assert_error(response, status: int, error_type: str) -> dict:
    """The one error shape; returns the error object."""
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert error["type"] == error_type
    assert isinstance(error["message"], str) and error["message"]
    assert ("fields" in error) == (error_type == "validation_error")
    return error
