from django.core.validators import ProhibitNullCharactersValidator
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator


def validated(serializer_class: type[serializers.Serializer], data, **kwargs) -> dict:
    """The input serializer's validated data; a ValidationError (400 with fields) otherwise."""
    serializer = serializer_class(data=data, **kwargs)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class ReasonSerializer(serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class DrainSerializer(ReasonSerializer):
    # Longest grace an operator may ask for: an hour, past which a drain is a stop by another name.
    grace_s = serializers.FloatField(
        required=False,
        min_value=0.0,
        max_value=3600.0,
        help_text="Seconds a decode worker keeps streaming before its requests migrate (default: the pool's).",
    )


class SlugRelatedField(serializers.SlugRelatedField):
    """Vets the slug the way a CharField does before looking it up: PostgreSQL refuses a query with a
    NUL character in it (a 500), and a lone surrogate cannot even be written back in the error."""

    def to_internal_value(self, data):
        if isinstance(data, str):
            ProhibitNullCharactersValidator()(data)
            ProhibitSurrogateCharactersValidator()(data)
        return super().to_internal_value(data)
