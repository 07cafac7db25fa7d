"""How large the KV cache is: the device's share less what the weights, the largest step's activations and
the CUDA graphs take, measured with the model loaded."""
