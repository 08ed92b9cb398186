"""Hook implementations of the ROCm plugin (everything heavy is imported inside them)."""

from omniinfer.platforms.hookspec import hookimpl

PLUGIN_API_VERSION = "2.0"


@hookimpl
def omniinfer_platforms():
    from omniinfer_rocm.platform import RocmPlatform

    return [RocmPlatform]


@hookimpl
def omniinfer_attention_backends():
    from omniinfer_rocm.attention.rocm_flash import RocmFlashBackend

    return [RocmFlashBackend]


@hookimpl
def omniinfer_quantization_kernels():
    from omniinfer.quantization.triton_kernel import TritonQuantKernel

    return [TritonQuantKernel]
