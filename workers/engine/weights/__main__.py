"""`python -m workers.engine.weights NAME`: resolve (and on first use convert) a model, print its directory."""

import sys

from workers.engine.weights import resolve_model
from workers.protocol.errors import EngineError


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m workers.engine.weights MODEL_NAME_OR_DIRECTORY", file=sys.stderr)
        return 2
    try:
        files = resolve_model(sys.argv[1], progress=True)
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(files.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
