"""`python manage.py ensure_topology --node NAME --model MODEL --pool prefill=1 --pool decode=1
[--quantization fp8] [--kv-cache-dtype fp8]`

The pools a deployment's workers register into, and the node its agent starts workers on, created
once (or updated) before the workers start: a worker whose pool does not exist is refused by the
registry until it does. The same service `serve` uses for the embedded stack."""

from django.core.management.base import CommandError

from controlplane.common.errors import DomainValidationError
from controlplane.common.migrated import MigratedDatabaseCommand
from controlplane.topology.models import PoolKind
from controlplane.topology.services import topology_ensure_local
from workers.args import KV_CACHE_DTYPES, QUANTIZATIONS


def _pool(value: str) -> tuple[str, str, int]:
    kind, _, count = value.partition("=")
    if kind not in PoolKind.values or not count.isdigit():
        raise ValueError(f"expected KIND=COUNT with KIND one of {sorted(PoolKind.values)}, got {value!r}")
    return kind, kind, int(count)


class Command(MigratedDatabaseCommand):
    help = "Create (or update) the cluster's pools and the node agent's node."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--node", required=True, help="hostname of the node agent (SLUICE_NODE_NAME)")
        parser.add_argument("--model", required=True, help="the model the pools serve")
        parser.add_argument(
            "--pool", action="append", required=True, help="KIND=COUNT: a pool named after its kind, at least COUNT"
        )
        # The pools' precision: what every worker their node agents start runs with (EngineArgs's settings).
        parser.add_argument("--quantization", choices=QUANTIZATIONS, help="quantize weights at load (default: none)")
        parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="KV cache storage")

    def handle(
        self,
        *args,
        node: str,
        model: str,
        pool: list[str],
        quantization: str | None,
        kv_cache_dtype: str,
        **options,
    ) -> None:
        try:
            pools = [_pool(value) for value in pool]
            topology_ensure_local(
                hostname=node,
                model=model,
                pools=pools,
                quantization=quantization or "",
                kv_cache_dtype=kv_cache_dtype,
            )
        except ValueError as error:
            raise CommandError(str(error)) from None
        except DomainValidationError as error:
            raise CommandError(error.message) from None
        self.stdout.write(f"pools {', '.join(f'{k} (min {n})' for _, k, n in pools)} and node {node!r} are in place")
