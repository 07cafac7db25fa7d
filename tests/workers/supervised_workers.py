"""`python -m tests.workers.supervised_workers COMMANDS_JSON`: worker processes under the embedded
deployment's supervisor (controlplane.supervisor), as `serve` runs them: one that crashes is
restarted, and SIGTERM stops them all. COMMANDS_JSON maps each worker's name to its command line."""

import json
import logging
import sys

from controlplane.supervisor import Child, Supervisor, child_env

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="supervisor: %(message)s")
    commands = json.loads(sys.argv[1])
    children = [Child(name=name, argv=argv, env=child_env()) for name, argv in commands.items()]
    sys.exit(Supervisor(children).run())
