from kernels.attention.torch_blockwise.attention import paged_attention_blockwise
from kernels.attention.torch_common.backend import TorchBackend


class TorchBlockwiseBackend(TorchBackend):
    name = "torch_blockwise"
    attend = staticmethod(paged_attention_blockwise)
