"""The device side of the model runner: the persistent input batch, on-device sampling, CUDA graphs."""
