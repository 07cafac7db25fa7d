"""The gateway side of the data plane: the engine client and its worker links, split prefill/decode
streams, the control client, prefill deadlines, crash suspects, and routing (prefix match, balancers)."""
