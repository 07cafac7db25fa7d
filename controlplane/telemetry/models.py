from django.db import models


class TelemetryRollup(models.Model):
    """What one gateway served in one minute, as its telemetry collector measured it. Several gateways
    each write their own row of a minute (`collector` names the collector process), and the selectors
    merge them: counts add up, latency histograms add up bucket by bucket and give the minute's
    percentiles (controlplane.telemetry.latency_histogram). kv_store_bytes is None for a minute
    without a store. Rows from before per-gateway rows (collector "") have counts but no latencies.
    The engine steps and KV handoffs come from the workers' heartbeats, which every gateway hears: each
    row counts all of them, so merging takes the largest row's instead of a sum."""

    minute = models.DateTimeField()  # the minute's start (UTC)
    collector = models.CharField(max_length=100, default="")  # "<hostname>:<pid>:<random>" of one process
    requests = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    generation_tokens = models.PositiveBigIntegerField(default=0)
    ttft_histogram = models.JSONField(default=dict)  # bucket index → requests, time to first token
    itl_histogram = models.JSONField(default=dict)  # bucket index → gaps between outputs
    kv_store_bytes = models.PositiveBigIntegerField(null=True)
    engine_steps = models.PositiveBigIntegerField(default=0)  # over every worker
    engine_step_seconds = models.FloatField(default=0.0)  # summed, each from launch to result read
    kv_handoffs = models.PositiveBigIntegerField(default=0)  # received, over every backend
    kv_handoff_seconds = models.FloatField(default=0.0)  # summed, each until its KV was usable
    # Speculative decoding over every worker: drafts (one per request and verify step), their draft
    # tokens verified and accepted, verify steps, and the draft tokens those steps verified in all.
    spec_drafts = models.PositiveBigIntegerField(default=0)
    spec_draft_tokens = models.PositiveBigIntegerField(default=0)
    spec_accepted_tokens = models.PositiveBigIntegerField(default=0)
    spec_steps = models.PositiveBigIntegerField(default=0)
    spec_budget_tokens = models.FloatField(default=0.0)

    class Meta:
        ordering = ["minute"]
        constraints = [models.UniqueConstraint(fields=["minute", "collector"], name="telemetryrollup_unique_minute")]

    def __str__(self) -> str:
        return f"telemetry {self.minute:%Y-%m-%d %H:%M} ({self.collector or 'before per-gateway rows'})"


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


class KVStoreGC(models.Model):
    """The latest report of one KV store GC process (manage.py run_kv_gc), rewritten after each of its
    runs: the store's size, its capacity and watermarks, and what the GC removed since it started. The
    dashboard and /metrics show it beside the workers' heartbeats (a worker that runs the GC itself
    reports the same in its heartbeats)."""

    gc_id = models.CharField(max_length=200, unique=True)
    hostname = models.CharField(max_length=255)
    store = models.CharField(max_length=1000)  # the block directory
    index_kind = models.CharField(max_length=20)  # "memory" or "redis"
    eviction_policy = models.CharField(max_length=50)
    capacity_bytes = models.PositiveBigIntegerField()
    low_watermark = models.FloatField()
    high_watermark = models.FloatField()
    interval_s = models.FloatField()
    num_blocks = models.PositiveBigIntegerField()
    num_bytes = models.PositiveBigIntegerField()
    evicted_expired = models.PositiveBigIntegerField()  # blocks removed for age since the process started
    evicted_capacity = models.PositiveBigIntegerField()  # blocks removed by the eviction policy
    bytes_freed = models.PositiveBigIntegerField()
    checkpoints_removed = models.PositiveBigIntegerField()  # checkpoint files no request could resume from
    started_at = models.DateTimeField()
    reported_at = models.DateTimeField()

    class Meta:
        verbose_name = "KV store GC"
        ordering = ["gc_id"]

    def __str__(self) -> str:
        return f"{self.gc_id} of {self.store}"


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


class EncodeLoadRollup(models.Model):
    """What a pool's encode workers were asked in one minute, as the collectors' ticks saw it: image
    patches that came to them (finished plus the growth of those held), the most they held at once,
    and the patches per second one encoder measured it encodes (0: none had). The autoscaler sizes
    encode pools from these."""

    pool = models.CharField(max_length=100)  # the pool's name, as heartbeats give it
    minute = models.DateTimeField()
    patches_demanded = models.PositiveBigIntegerField()
    peak_patches_in_flight = models.PositiveBigIntegerField()
    patches_per_second = models.FloatField()

    class Meta:
        ordering = ["minute"]
        constraints = [models.UniqueConstraint(fields=["pool", "minute"], name="encodeload_unique_minute")]

    def __str__(self) -> str:
        return f"encode load {self.pool} {self.minute:%Y-%m-%d %H:%M}"
