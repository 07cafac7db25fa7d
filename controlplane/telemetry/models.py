from django.db import models


class TelemetryRollup(models.Model):
    """What the gateway served in one minute, as its telemetry collector measured it. Latency
    percentiles are None for a minute without a sample; kv_store_bytes for one without a store."""

    minute = models.DateTimeField(unique=True)  # the minute's start (UTC)
    requests = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    generation_tokens = models.PositiveBigIntegerField(default=0)
    ttft_p50_s = models.FloatField(null=True)
    ttft_p99_s = models.FloatField(null=True)
    itl_p50_s = models.FloatField(null=True)
    itl_p99_s = models.FloatField(null=True)
    kv_store_bytes = models.PositiveBigIntegerField(null=True)

    class Meta:
        ordering = ["minute"]

    def __str__(self) -> str:
        return f"telemetry {self.minute:%Y-%m-%d %H:%M}"


class ExpertLoadRollup(models.Model):
    """Tokens routed to each physical expert slot of a pool in one minute, summed over its workers'
    heartbeats, under one EP layout version: slot_loads[layer][rank * slots_per_rank + slot]."""

    pool = models.CharField(max_length=100)  # the pool's name, as heartbeats give it
    layout_version = models.PositiveIntegerField()  # 0: no layout was in force
    minute = models.DateTimeField()
    slot_loads = models.JSONField()

    class Meta:
        ordering = ["minute"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "layout_version", "minute"], name="expertload_unique_minute")
        ]

    def __str__(self) -> str:
        return f"expert load {self.pool} v{self.layout_version} {self.minute:%Y-%m-%d %H:%M}"


class DecodeLoadRollup(models.Model):
    """The most a pool's decode (and mixed) workers held together at any collector tick of one
    minute: requests in flight (running and waiting) and KV tokens in use. The autoscaler's quota
    guard reads the look-back's peak from these."""

    pool = models.CharField(max_length=100)  # the pool's name, as heartbeats give it
    minute = models.DateTimeField()
    peak_requests_in_flight = models.PositiveIntegerField()
    peak_kv_tokens = models.PositiveBigIntegerField()

    class Meta:
        ordering = ["minute"]
        constraints = [models.UniqueConstraint(fields=["pool", "minute"], name="decodeload_unique_minute")]

    def __str__(self) -> str:
        return f"decode load {self.pool} {self.minute:%Y-%m-%d %H:%M}"
