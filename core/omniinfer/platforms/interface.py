"""What a device plugin must describe: the :class:`Platform` contract.

A platform is one kind of device (CUDA GPUs, ROCm GPUs, Intel GPUs, CPUs). Subclasses
state only what differs; everything here has a sensible default except the identity
attributes and :meth:`Platform.is_available`.

Rules for implementers:

* Class attributes and ``is_available()`` must be cheap: no device context, no vendor
  library import unless the vendor's torch build is present (``torch`` itself is fine).
* Methods that touch the device (``set_device``, ``kv_cache_memory_bytes``...) are only
  called on the selected platform, after selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from omniinfer.config import EngineConfig


ENV_GPU_MEMORY_UTILIZATION = "OMNIINFER_GPU_MEMORY_UTILIZATION"


def host_kv_budget(config: EngineConfig, max_bytes: int = 4 << 30) -> int:
    """KV-cache bytes from host memory: what `max_num_seqs` full-length sequences need, at most a
    quarter of available memory (shared by the ranks of a parallel run) and `max_bytes`."""
    from omniinfer.platforms.host import available_memory_bytes
    from omniinfer.worker.cache_engine import block_bytes

    m = config.model
    tokens = config.scheduler.max_num_seqs * m.max_model_len
    useful = block_bytes(m.num_layers, 1, m.num_kv_heads, m.head_size, m.dtype) * tokens
    share = available_memory_bytes() // 4 // config.parallel.world_size
    return int(min(max_bytes, share, useful))


def accelerator_kv_budget(config: EngineConfig, free_bytes: int, total_bytes: int) -> int:
    """KV-cache bytes on an accelerator, measured after the model is loaded.

    Use up to `gpu_memory_utilization` (the engine argument; else
    `OMNIINFER_GPU_MEMORY_UTILIZATION`; default 0.9) of the device's total memory,
    counting what is already taken (weights, other processes), and keep room for the
    step's activations: the largest batch's hidden and MLP tensors, the logits, and a
    quantized model's transient dequantised weight (`dequant_workspace_bytes`).
    """
    import os

    utilization = config.cache.gpu_memory_utilization
    name = "gpu_memory_utilization"
    if utilization is None:
        utilization, name = float(os.environ.get(ENV_GPU_MEMORY_UTILIZATION, "0.9")), ENV_GPU_MEMORY_UTILIZATION
    if not 0 < utilization <= 1:
        raise ValueError(f"{ENV_GPU_MEMORY_UTILIZATION}={utilization} is not allowed; it must be in (0, 1]")
    m, s = config.model, config.scheduler
    itemsize = m.dtype_bytes
    intermediate = int(m.hf_config.get("intermediate_size", 4 * m.hidden_size))
    activations = s.max_num_batched_tokens * (6 * m.hidden_size + 3 * intermediate) * itemsize
    logits = s.max_num_seqs * m.vocab_size * 4 * 3
    used = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - used - activations - logits - dequant_workspace_bytes(config)
    if budget <= 0:
        raise ValueError(f"no device memory left for the KV cache: {free_bytes / 2**30:.2f} GiB free of "
                         f"{total_bytes / 2**30:.2f} GiB with {name}={utilization}; "
                         "lower max_num_batched_tokens / max_num_seqs or use a smaller model")
    return budget


def dequant_workspace_bytes(config: EngineConfig) -> int:
    """What a quantized model's products hold for a moment on an accelerator: past a few rows
    the Triton layers dequantise a weight (at most DEQUANT_WORKSPACE_BYTES at a time, and never
    more than one rank's largest layer in the activation dtype: gate_up, or the LM head), and the
    reference dequantises slices of REFERENCE_SLICE_BYTES. Torch's caching allocator keeps that
    memory once a prefill used it. 0 for a float model."""
    from omniinfer.quantization.base import DEQUANT_WORKSPACE_BYTES, REFERENCE_SLICE_BYTES

    m = config.model
    if not m.quantization:
        return 0
    tp = config.parallel.tensor_parallel_size
    intermediate = int(m.hf_config.get("intermediate_size", 4 * m.hidden_size))
    largest = max(2 * intermediate, m.vocab_size) * m.hidden_size * m.dtype_bytes // tp
    return min(max(DEQUANT_WORKSPACE_BYTES, REFERENCE_SLICE_BYTES), largest)


@dataclass(frozen=True, slots=True)
class Availability:
    """The answer of :meth:`Platform.is_available`: a verdict and why."""

    is_available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.is_available


class Platform:
    """One kind of device, described for the engine.

    Identity (class attributes, override in every subclass):

    * ``name``: the user-facing name (``device="cuda"``, ``OMNIINFER_DEVICE=cuda``).
    * ``device_type``: the torch device type string (ROCm also uses ``"cuda"``).
    * ``priority``: higher wins when several platforms are available.
    * ``dist_backend``: the ``torch.distributed`` backend name.
    * ``attention_backend_preferences``: backend names, best first.
    * ``supported_dtypes``: the model dtypes this platform can run.
    * ``ray_resource``: what one rank reserves in a Ray placement group ("GPU", "CPU"...).
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    dist_backend: ClassVar[str] = "gloo"
    attention_backend_preferences: ClassVar[tuple[str, ...]] = ("TORCH_SDPA", "REFERENCE")
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    ray_resource: ClassVar[str] = "GPU"  # the Ray resource one rank reserves

    # Lowest device capability Triton generates code for on this platform (None: no floor).
    min_triton_capability: ClassVar[tuple[int, int] | None] = None
    # True: decode steps replay device graphs, captured through the CUDA graph API of torch's
    # module for `device_type` (torch.cuda on NVIDIA, and on ROCm's HIP build)
    supports_graph_capture: ClassVar[bool] = False

    # Set by the registry: the distribution that provided it, and its version.
    plugin_name: ClassVar[str] = ""
    plugin_version: ClassVar[str] = ""

    # ---- detection -------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> Availability:
        """Whether this machine can run this platform, and a human-readable reason."""
        raise NotImplementedError

    @classmethod
    def build_info(cls) -> str:
        """The vendor toolkit torch was built with, e.g. "cuda 12.4" ("" when not applicable)."""
        return ""

    @classmethod
    def runtime_info(cls) -> dict:
        """Facts of this platform's own run-time for `omniinfer env` (called only for the
        selected platform, so it may load the plugin's kernels): JSON-able. A value that is a
        dict of ``{"active": bool, "why": str}`` entries is shown as a table (e.g. which kernel
        families run, and why not); anything else as ``key: value``. {} by default."""
        return {}

    @classmethod
    def device_capability(cls) -> tuple[int, int] | None:
        """(major, minor) of device 0 where the vendor has such a notion (CUDA), else None."""
        return None

    @classmethod
    def device_arch(cls) -> str | None:
        """The architecture device 0's kernels are compiled for ("sm_90", "gfx942"), named as
        the kernel catalogue names its targets (kernels/triton/catalogue.py); None off-GPU."""
        return None

    @classmethod
    def attention_spec(cls, *, dtype: torch.dtype, head_size: int, num_heads: int,
                       num_kv_heads: int, block_size: int, sliding_window: int | None = None,
                       logits_soft_cap: float | None = None):
        """The `AttentionSpec` backends validate against on this platform (its device type,
        name, capability and kernel floors filled in)."""
        from omniinfer.attention.backend import AttentionSpec

        return AttentionSpec(device_type=cls.device_type, platform_name=cls.name, dtype=dtype,
                             head_size=head_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             block_size=block_size, sliding_window=sliding_window,
                             logits_soft_cap=logits_soft_cap, device_capability=cls.device_capability(),
                             min_triton_capability=cls.min_triton_capability,
                             device_arch=cls.device_arch())

    @classmethod
    def device_names(cls) -> list[str]:
        """Names of the devices found (for logs and `omniinfer env`); cheap."""
        return []

    # ---- what the engine asks of the selected platform ---------------------------------
    @classmethod
    def model_transform(cls, config: EngineConfig, attn_backend: type):
        """This platform's load-time changes to the model: a `ModelTransform`
        (models/transform.py; import it lazily), or None to run the model as loaded, on torch
        ops. Called once per worker, before the model loads."""
        return None

    @classmethod
    def model_runner_cls(cls) -> type:
        """The model runner (the core's; a platform has no need to replace it: it declares what
        differs through `model_transform` and `supports_graph_capture`)."""
        from omniinfer.worker.model_runner import ModelRunner

        return ModelRunner

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        import torch

        if cls.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(cls.device_type, local_rank)

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        """Bind this process to its device (called once per worker before any allocation)."""

    @classmethod
    def synchronize(cls) -> None:
        """Wait for the device's queued work (used by benchmarks and timing)."""

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def max_local_ranks(cls) -> int | None:
        """How many ranks one machine can run: one per device by default; None for no limit
        (ranks that share one device, as CPU ranks share the cores)."""
        return cls.device_count()

    @classmethod
    def kv_cache_memory_bytes(cls, config: EngineConfig, model_bytes: int) -> int:
        """Bytes the KV cache may take on one device, given the loaded model's size.

        The default, for a platform that says nothing better: where torch's module for
        `device_type` reports the device's memory (`mem_get_info`), the accelerator rule
        (`accelerator_kv_budget`); otherwise the host rule (`host_kv_budget`). Either way the
        log says which, and `kv_cache_memory_bytes=` / `num_kv_blocks=` override it."""
        import torch

        from omniinfer.logger import init_logger

        try:
            module = torch.get_device_module(cls.device_type)
        except (RuntimeError, ValueError, AttributeError):
            module = None
        if cls.device_type != "cpu" and hasattr(module, "mem_get_info"):
            module.synchronize()
            free, total = module.mem_get_info()
            budget, rule = accelerator_kv_budget(config, free, total), "the device's free memory"
        else:
            budget, rule = host_kv_budget(config), "the host rule (min of what max_num_seqs " \
                "full-length sequences need, a quarter of available memory, 4 GiB)"
        init_logger(__name__).info(
            "platform %s does not size its KV cache: %.2f GiB from %s (set kv_cache_memory_bytes "
            "or num_kv_blocks to choose)", cls.name, budget / (1 << 30), rule)
        return budget

    @classmethod
    def prompt_logits_bytes(cls) -> int | None:
        """Bytes of float32 logits one step may make for prompts owed log-probs (lm-evaluation-
        harness' loglikelihood asks for every prompt token's): such prompts then get no more
        tokens a step, all together, than rows of the vocabulary that holds. None (the default):
        no bound but the step's token budget."""
        return None

    @classmethod
    def auto_dtype(cls, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """The dtype `dtype="auto"` runs a checkpoint saved in `checkpoint_dtype` in (the
        default: that one). A platform that runs it badly names a better one."""
        return checkpoint_dtype

    @classmethod
    def verify_config(cls, config: EngineConfig) -> list[str]:
        """Reasons this platform cannot run `config` (empty: it can).

        The default checks the dtype against ``supported_dtypes``; subclasses extend it.
        """
        from omniinfer.config import dtype_name

        reasons = []
        dtype = dtype_name(config.model.dtype)
        if dtype not in cls.supported_dtypes:
            reasons.append(
                f"dtype {dtype!r} is not supported on {cls.name}; "
                f"supported: {', '.join(cls.supported_dtypes)}"
            )
        return reasons

    @classmethod
    def pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def describe(cls) -> str:
        return f"{cls.name} (plugin {cls.plugin_name or '?'} {cls.plugin_version or ''})".strip()
