"""`python -m controlplane.cli`: the `sluice` console script, where it is not installed."""

from controlplane.cli.main import main

main()
