"""The server's prefix-cache counters from its Prometheus `/metrics`, read before and after a run.

vLLM v1 exports `vllm:prefix_cache_queries_total` (prompt tokens looked up) and
`vllm:prefix_cache_hits_total` (those served from the cache); our gateway exports the same names. A
counter's samples are summed over their labels (vLLM labels them per engine and model). A server
without the endpoint or the counters gives None, reported as null.
"""

import asyncio
import re
from dataclasses import dataclass

import httpx

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class PrefixCacheCounters:
    queries: float
    hits: float


async def scrape_prefix_cache(http: httpx.AsyncClient, path: str = "/metrics") -> PrefixCacheCounters | None:
    try:
        response = await http.get(path)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals = counter_totals(response.text, (QUERIES, HITS))
    if totals[QUERIES] is None or totals[HITS] is None:
        return None
    return PrefixCacheCounters(queries=totals[QUERIES], hits=totals[HITS])


async def scrape_after_run(
    http: httpx.AsyncClient, before: PrefixCacheCounters | None, prompt_tokens: int, *, attempts: int = 20
) -> PrefixCacheCounters | None:
    """The counters once they cover `prompt_tokens` more queries than `before`, or as they are after `attempts`."""
    after = await scrape_prefix_cache(http)
    for _ in range(attempts - 1):
        if before is None or after is None or after.queries - before.queries >= prompt_tokens:
            break
        await asyncio.sleep(0.1)
        after = await scrape_prefix_cache(http)
    return after


def prefix_cache_report(before: PrefixCacheCounters | None, after: PrefixCacheCounters | None) -> dict:
    """The run's queried and hit tokens and their ratio; nulls when a scrape failed or nothing was queried."""
    if before is None or after is None:
        return {"server_queried_tokens": None, "server_hit_tokens": None, "server_hit_rate": None}
    queries, hits = after.queries - before.queries, after.hits - before.hits
    return {
        "server_queried_tokens": queries,
        "server_hit_tokens": hits,
        "server_hit_rate": hits / queries if queries > 0 else None,
    }


def counter_totals(exposition: str, names: tuple[str, ...]) -> dict[str, float | None]:
    """Each named metric's value summed over its samples in a Prometheus text exposition; None if absent."""
    totals: dict[str, float | None] = dict.fromkeys(names)
    for line in exposition.splitlines():
        sample = _sample(line.strip())
        if sample is not None and sample[0] in totals:
            totals[sample[0]] = (totals[sample[0]] or 0.0) + sample[1]
    return totals


def _sample(line: str) -> tuple[str, float] | None:
    """A sample line's metric name and value (`name{labels} value [timestamp]`); None for other lines."""
    if not line or line.startswith("#"):
        return None
    name = _NAME.match(line)
    if name is None:
        return None
    rest = line[name.end() :]
    if rest.startswith("{"):
        rest = rest[_labels_end(rest) :]
    fields = rest.split()
    if not fields:
        return None
    try:
        return name.group(), float(fields[0])
    except ValueError:
        return None


def _labels_end(text: str) -> int:
    """The index just past the `}` closing the label set that `text` opens (label values may hold `}`)."""
    quoted = escaped = False
    for index, char in enumerate(text):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "}" and not quoted:
            return index + 1
    return len(text)
