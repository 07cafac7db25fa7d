"""The model runner (the only engine component that builds tensors) and its device side: the
persistent input batch, on-device sampling, CUDA graphs."""
