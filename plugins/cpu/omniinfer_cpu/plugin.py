"""Hook implementations of the CPU plugin (everything heavy is imported inside them)."""

from omniinfer.platforms.hookspec import hookimpl

PLUGIN_API_VERSION = "2.0"


@hookimpl
def omniinfer_platforms():
    from omniinfer_cpu.platform import CpuPlatform

    return [CpuPlatform]


@hookimpl
def omniinfer_attention_backends():
    from omniinfer_cpu.attention.ipex import IpexCpuBackend
    from omniinfer_cpu.attention.paged import CpuPagedBackend

    return [IpexCpuBackend, CpuPagedBackend]


@hookimpl
def omniinfer_quantization_kernels():
    from omniinfer_cpu.quant import CpuQuantKernel

    return [CpuQuantKernel]
