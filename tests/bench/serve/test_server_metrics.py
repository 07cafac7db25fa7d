from bench.serve.server_metrics import HITS, QUERIES, PrefixCacheCounters, counter_totals, prefix_cache_report

EXPOSITION = """\
# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="a } b, \\"c\\""} 800
vllm:prefix_cache_queries_created{engine="0"} 1.7e9
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total 500 1712345678000
vllm:prefix_cache_hits_total_other 7
sluice:kv_store_blocks{pool="p"} NaN
"""


def test_counters_are_summed_over_their_labels():
    totals = counter_totals(EXPOSITION, (QUERIES, HITS, "sluice:missing"))

    assert totals == {QUERIES: 2000.0, HITS: 500.0, "sluice:missing": None}


def test_the_run_hit_rate_is_the_change_in_the_counters():
    report = prefix_cache_report(
        PrefixCacheCounters(queries=1000, hits=100), PrefixCacheCounters(queries=3000, hits=1100)
    )

    assert report == {"server_queried_tokens": 2000, "server_hit_tokens": 1000, "server_hit_rate": 0.5}


def test_missing_counters_are_nulls():
    nulls = {"server_queried_tokens": None, "server_hit_tokens": None, "server_hit_rate": None}
    assert prefix_cache_report(None, PrefixCacheCounters(queries=1, hits=1)) == nulls
    unchanged = prefix_cache_report(PrefixCacheCounters(queries=5, hits=1), PrefixCacheCounters(queries=5, hits=1))
    assert unchanged["server_hit_rate"] is None
