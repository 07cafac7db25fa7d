"""The one error `recipe` raises for a request it refuses; the gateway renders it per protocol."""


class ApiError(Exception):
    """A request the API refuses: `status` 400 (invalid), 404 (unknown model), 413 (too large).

    `type` follows OpenAI's names ("invalid_request_error", "not_found_error"); `param` names the
    offending request field when there is one.
    """

    def __init__(self, status: int, type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.type!r}, {self.message!r}, param={self.param!r})"


def invalid_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param)
