"""Hook implementations of the CUDA plugin (everything heavy is imported inside them)."""

from omniinfer.platforms.hookspec import hookimpl

PLUGIN_API_VERSION = "2.0"


@hookimpl
def omniinfer_platforms():
    from omniinfer_cuda.platform import CudaPlatform

    return [CudaPlatform]


@hookimpl
def omniinfer_attention_backends():
    from omniinfer_cuda.attention.flash_attn import FlashAttentionBackend
    from omniinfer_cuda.attention.xformers import XFormersBackend

    return [FlashAttentionBackend, XFormersBackend]


@hookimpl
def omniinfer_quantization_kernels():
    from omniinfer.quantization.triton_kernel import TritonQuantKernel

    return [TritonQuantKernel]
