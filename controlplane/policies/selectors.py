from django.db.models import Max, OuterRef, QuerySet, Subquery

from controlplane.policies.models import DEFAULT_TRAFFIC_CLASS, EPLayout, EPRebalancePolicy, TrafficClass, TTLPolicy


def traffic_class_list() -> QuerySet[TrafficClass]:
    return TrafficClass.objects.order_by("name")


def ttl_policy_list(*, traffic_class_id: int | None = None) -> QuerySet[TTLPolicy]:
    policies = TTLPolicy.objects.select_related("traffic_class")
    return policies if traffic_class_id is None else policies.filter(traffic_class_id=traffic_class_id)


def ttl_policies_latest() -> QuerySet[TTLPolicy]:
    """The newest version of each class's TTL: the ones that apply."""
    newest = TTLPolicy.objects.filter(traffic_class=OuterRef("traffic_class")).order_by("-version").values("version")
    return TTLPolicy.objects.select_related("traffic_class").filter(version=Subquery(newest[:1]))


def ttl_policy_current() -> dict:
    """What workers apply: {"revision", "ttl_s": {class: seconds}, "default_class"}.

    Without "revision" it is what workers.kvstore.ttl.TTLPolicy.from_dict takes. The revision is the
    largest TTLPolicy id: it grows with every new version of any class, so workers can tell which
    of two pushes is newer.
    """
    ttl_s = {policy.traffic_class.name: policy.ttl_seconds for policy in ttl_policies_latest()}
    revision = TTLPolicy.objects.aggregate(revision=Max("id"))["revision"] or 0
    return {"revision": revision, "ttl_s": ttl_s, "default_class": DEFAULT_TRAFFIC_CLASS}


def ep_layout_list(*, pool_id: int | None = None) -> QuerySet[EPLayout]:
    layouts = EPLayout.objects.select_related("pool")
    return layouts if pool_id is None else layouts.filter(pool_id=pool_id)


def ep_layout_active(*, pool_id: int) -> EPLayout | None:
    return EPLayout.objects.filter(pool_id=pool_id, is_active=True).first()


def ep_rebalance_policy_list() -> QuerySet[EPRebalancePolicy]:
    return EPRebalancePolicy.objects.select_related("pool")
