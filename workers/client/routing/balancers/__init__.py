"""Prefill and decode load balancers, and the baselines they are measured against."""
