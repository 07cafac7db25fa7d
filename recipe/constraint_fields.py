"""The request field an output constraint comes from, by protocol and constraint kind: what an error
about the constraint's grammar names as its `param`."""

from workers.protocol.messages import OutputConstraintSpec

_FORMAT_FIELDS = {"chat.completions": "response_format", "responses": "text.format"}
TOOLS_FIELD = "tools"  # every protocol's tool list (and Anthropic's only constraint)


def constraint_field(protocol: str, constraint: OutputConstraintSpec) -> str:
    """ "response_format" (Chat Completions), "text.format" (Responses) for a JSON schema or regex;
    "tools" for a tool-call grammar."""
    if constraint.kind in ("json", "regex"):
        return _FORMAT_FIELDS.get(protocol, "response_format")
    return TOOLS_FIELD
