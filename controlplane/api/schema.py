"""OpenAPI: every operation documents the error body it can answer with, next to its success response.

401 and 403 everywhere, 400 for writes and filtered lists, 404 for paths with an id; a viewset adds
others per action in `error_responses`, e.g. {"scale": {"409": "Rate limit hit."}}.
"""

from drf_spectacular import openapi
from rest_framework import serializers

from controlplane.api.errors import ERROR_TYPES


class ErrorDetailSerializer(serializers.Serializer):
    type = serializers.ChoiceField(choices=ERROR_TYPES)
    message = serializers.CharField()
    # Declared fields are collected by the serializer's metaclass, so this one does not shadow `Serializer.fields`.
    fields = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        required=False,
        help_text="Validation errors only: messages per input field (nested fields as dotted paths).",
    )


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class AutoSchema(openapi.AutoSchema):
    def get_operation(self, *args, **kwargs):
        operation = super().get_operation(*args, **kwargs)
        if operation is None:  # excluded from the schema
            return None
        errors = {
            "401": "Not authenticated, or an invalid or revoked API key.",
            "403": "The caller's role does not allow this.",
        }
        if "requestBody" in operation or getattr(self.view, "action", None) == "list":
            errors["400"] = "Invalid input; `fields` says which."
        if "{" in self.path:
            errors["404"] = "No such object, or not one the caller may see."
        errors.update(getattr(self.view, "error_responses", {}).get(getattr(self.view, "action", None), {}))
        error_schema = self.resolve_serializer(ErrorSerializer, "response").ref
        documented = {
            code: {"description": description, "content": {"application/json": {"schema": error_schema}}}
            for code, description in errors.items()
        }
        operation["responses"] = dict(sorted({**documented, **operation["responses"]}.items()))
        return operation
