"""Hook implementations of the XPU plugin (everything heavy is imported inside them)."""

from omniinfer.platforms.hookspec import hookimpl

PLUGIN_API_VERSION = "2.0"


@hookimpl
def omniinfer_platforms():
    from omniinfer_xpu.platform import XpuPlatform

    return [XpuPlatform]


@hookimpl
def omniinfer_attention_backends():
    from omniinfer_xpu.attention.ipex import IpexXpuBackend

    return [IpexXpuBackend]


@hookimpl
def omniinfer_quantization_kernels():
    from omniinfer.quantization.triton_kernel import TritonQuantKernel

    return [TritonQuantKernel]
