from datetime import UTC

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField
from rest_framework.filters import OrderingFilter


class StableOrderingFilter(OrderingFilter):
    """Any ordering, with the primary key as the last tie-breaker, so pages never overlap or skip rows."""

    def get_ordering(self, request, queryset, view):
        ordering = list(super().get_ordering(request, queryset, view) or ["pk"])
        if not {"pk", "-pk", "id", "-id"} & set(ordering):
            ordering.append("-pk" if ordering[0].startswith("-") else "pk")
        return ordering


class UTCIsoDateTimeField(IsoDateTimeField):
    """ISO 8601 allows UTC offsets up to ±23:59, PostgreSQL only up to ±15:59: compare in UTC."""

    def to_python(self, value):
        value = super().to_python(value)
        if value is None:
            return None
        try:
            return value.astimezone(UTC)
        except OverflowError as error:  # year 1 or 9999 pushed over the edge by the offset
            raise forms.ValidationError("Out of range.", code="invalid") from error


class UTCDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UTCIsoDateTimeField
