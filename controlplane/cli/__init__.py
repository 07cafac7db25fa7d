"""The `sluice` console script (main), the checks it makes before starting anything (preflight)."""
