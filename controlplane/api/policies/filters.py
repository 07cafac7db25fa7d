import django_filters

from controlplane.policies.models import EPLayout, TTLPolicy


class TTLPolicyFilter(django_filters.FilterSet):
    traffic_class = django_filters.CharFilter(field_name="traffic_class__name", label="Traffic class name.")

    class Meta:
        model = TTLPolicy
        fields = ["traffic_class"]


class EPLayoutFilter(django_filters.FilterSet):
    class Meta:
        model = EPLayout
        fields = ["pool", "is_active"]
