import django_filters

from controlplane.api.filters import UTCDateTimeFilter
from controlplane.topology.models import EngineInstance, Node, Pool, ScalingEvent


class NodeFilter(django_filters.FilterSet):
    class Meta:
        model = Node
        fields = ["cluster", "accelerator_kind"]


class PoolFilter(django_filters.FilterSet):
    class Meta:
        model = Pool
        fields = ["cluster", "kind", "model"]


class EngineInstanceFilter(django_filters.FilterSet):
    class Meta:
        model = EngineInstance
        fields = ["pool", "node", "state"]


class ScalingEventFilter(django_filters.FilterSet):
    since = UTCDateTimeFilter(field_name="created_at", lookup_expr="gte", label="Created at or after.")
    until = UTCDateTimeFilter(field_name="created_at", lookup_expr="lt", label="Created before.")

    class Meta:
        model = ScalingEvent
        fields = ["pool", "instance", "action", "since", "until"]
