"""`python -m bench.fuzz_api`: see the package's docstring."""

import argparse
import json
import sys

import httpx

from bench import fuzz_api
from bench.fuzz_api import REQUEST_TIMEOUT_S, FuzzReport, fuzz, still_serving, workers


def main() -> None:
    parser = argparse.ArgumentParser(description=fuzz_api.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--derandomize", action="store_true", help="the same requests every run")
    args = parser.parse_args()
    report = FuzzReport()
    with httpx.Client(base_url=args.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        before = workers(client)
        fuzz(client, args.api_key, examples=args.examples, derandomize=args.derandomize, report=report, fail_fast=False)
        after = workers(client)
        serving = still_serving(client, args.api_key)
    summary = {
        "sent": report.sent,
        "statuses": dict(sorted(report.statuses.items())),
        "problems": report.problems,
        "workers_before": before,
        "workers_after": after,
        "still_serving": serving,
    }
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    sys.exit(0 if serving and not report.problems and before == after else 1)


if __name__ == "__main__":
    main()
