from kernels.attention.torch_common.backend import TorchBackend
from kernels.attention.torch_sdpa.attention import paged_attention_sdpa


class TorchSdpaBackend(TorchBackend):
    name = "torch_sdpa"
    attend = staticmethod(paged_attention_sdpa)
