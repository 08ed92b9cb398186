"""Engine configuration: plain dataclasses, validated where they are built.

`EngineArgs` is the flat, user-facing set of arguments (`LLM(...)` keywords, CLI flags).
`EngineArgs.create_engine_config()` reads the checkpoint's config.json (checkpoint_config.py), resolves defaults
and returns an `EngineConfig` made of one dataclass per concern.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from omniinfer.hf_config import layer_kinds, rope_scaling, rope_theta  # noqa: F401 - re-exported

SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
PREEMPTION_MODES = ("recompute", "swap")
EXECUTOR_BACKENDS = ("uniprocess", "mp", "ray")
DEFAULT_WORKER_CLS = "omniinfer.worker.worker_base.Worker"
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
GiB = 1 << 30
MAX_SCHEDULER_STEPS = 64


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name}={value} is not allowed; it must be >= {minimum}")


@dataclass(slots=True)
class ModelConfig:
    """The checkpoint, as the engine needs it (read from config.json, not from transformers)."""

    model: str
    tokenizer: str
    dtype: torch.dtype
    max_model_len: int
    seed: int
    architecture: str
    hf_config: dict  # config.json as loaded
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    eos_token_ids: list[int] = field(default_factory=list)  # from generation_config.json / config.json
    generation_config: dict = field(default_factory=dict)
    max_logprobs: int = 20  # most log-probabilities a request may ask for per token (<= vocab_size)
    quantization: str | None = None  # "gguf", "gptq", "awq", "compressed-tensors", "fp8" (the checkpoint), "int8" / "fp8" (made at load)
    trust_remote_code: bool = False  # the tokenizer may run code shipped with the checkpoint
    dtype_is_auto: bool = False  # dtype="auto": the checkpoint's, which the platform may change
    # the checkpoint's own architecture when only its language model is served (a multimodal
    # checkpoint's text part: checkpoint_config.TEXT_PARTS), else None
    text_part_of: str | None = None

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def sliding_window(self) -> int | None:
        """The window of the model's sliding-window layers (None: every layer attends fully)."""
        cfg = self.hf_config
        if cfg.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            return None
        window = cfg.get("sliding_window")
        if not window or not any(w is not None for w in layer_kinds(cfg, self.num_layers, True)):
            return None
        return int(window)

    @property
    def attention_soft_cap(self) -> float | None:
        """Gemma 2's attention-score soft cap (transformers applies it for Gemma 2 only)."""
        cap = self.hf_config.get("attn_logit_softcapping")
        return float(cap) if cap and self.hf_config.get("model_type") == "gemma2" else None

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer: the keys a query sees (itself included) in a sliding-window layer, None in
        a full-attention one (config.json's `layer_types`, else each family's pattern)."""
        window = self.sliding_window
        return [window if sliding else None for sliding in layer_kinds(self.hf_config, self.num_layers)]


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # forced number of device blocks (else from memory)
    kv_cache_memory_bytes: int | None = None  # device bytes for the KV cache (else platform default)
    swap_space: float = 4.0  # GiB of host memory for swap preemption
    enable_prefix_caching: bool = False
    # share of an accelerator's memory that weights, activations and the KV cache may take
    # (vLLM's --gpu-memory-utilization); None: OMNIINFER_GPU_MEMORY_UTILIZATION, else 0.9
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float))
                              or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization={u!r} is not allowed; it must be in (0, 1]")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size!r} is not supported; "
                             f"allowed: {', '.join(map(str, SUPPORTED_BLOCK_SIZES))}")
        _check_int("num_kv_blocks", self.num_kv_blocks, minimum=1, allow_none=True)
        _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1, allow_none=True)
        if not isinstance(self.swap_space, (int, float)) or not math.isfinite(self.swap_space) \
                or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r} GiB is not allowed; it must be a "
                             "finite number >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    num_lookahead_slots: int = 0  # extra KV slots reserved per decode (speculative decoding)
    num_scheduler_steps: int = 1  # decode steps run per scheduling step (multi-step decoding)

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("num_scheduler_steps", self.num_scheduler_steps, minimum=1)
        if self.num_scheduler_steps > MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} is not allowed; it "
                             f"must be <= {MAX_SCHEDULER_STEPS}")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} is not supported; "
                             f"allowed: {', '.join(map(repr, PREEMPTION_MODES))}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens with chunked prefill disabled; raise "
                "max_num_batched_tokens, lower max_model_len or set enable_chunked_prefill=True")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_num_seqs={self.max_num_seqs}: one step could not give every running "
                "sequence a token; raise max_num_batched_tokens or lower max_num_seqs")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uniprocess", "mp", "ray"; None = pick
    worker_cls: str = DEFAULT_WORKER_CLS  # "module.Class" of every rank's worker

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, minimum=1)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} is not supported; "
                             f"allowed: {', '.join(map(repr, EXECUTOR_BACKENDS))} or None (pick)")
        if backend == "uniprocess" and self.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uniprocess' runs one rank, but "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}; "
                             "use 'mp' (one machine) or 'ray'")
        if not isinstance(self.worker_cls, str) or "." not in self.worker_cls:
            raise ValueError(f"worker_cls={self.worker_cls!r} must name a class as 'module.Class'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def check_parallel_sizes(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse, before any process starts, a split the model's shapes do not allow."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if model.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                         f"num_attention_heads={model.num_heads}")
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads={kv} "
                         "must divide one another (KV heads are split, or replicated when "
                         "there are fewer than ranks)")
    for field_name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        size = int(model.hf_config.get(field_name) or 0)
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's "
                             f"{field_name}={size}")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's "
                         f"num_hidden_layers={model.num_layers}: every stage needs a layer")


@dataclass(slots=True)
class DeviceConfig:
    device: str | None = None  # platform name; None = the best available
    attention_backend: str | None = None  # backend name; None = the platform's first usable
    enforce_eager: bool = False  # never replay device graphs for decode steps


MAX_SPECULATIVE_TOKENS = 32


@dataclass(slots=True)
class SpeculativeConfig:
    draft: ModelConfig  # the draft model (same vocabulary; dtype and max_model_len of the target)
    num_speculative_tokens: int  # k: tokens drafted per step


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None


SPECULATIVE_CONFIG_KEYS = ("model", "num_speculative_tokens", "method", "draft_tensor_parallel_size")


@dataclass
class EngineArgs:
    """Every engine argument, flat, with its default (the `LLM(...)` keywords)."""

    model: str
    tokenizer: str | None = None
    device: str | None = None
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4.0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    attention_backend: str | None = None
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_cls: str = DEFAULT_WORKER_CLS
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    # vLLM's current spelling of the two above: {"model": ..., "num_speculative_tokens": k}
    speculative_config: dict | None = None
    num_scheduler_steps: int | None = None  # None: 1 (the offline LLM class picks 8)
    max_logprobs: int = 20  # a request's logprobs / prompt_logprobs at most; -1: the vocabulary
    quantization: str | None = None  # "int8" / "fp8": quantise a float checkpoint at load; a .gguf is "gguf"
    gpu_memory_utilization: float | None = None  # accelerators' memory share (CacheConfig)
    trust_remote_code: bool = False  # let the tokenizer run the checkpoint's code (models are ours)
    # vLLM's, accepted for its launch lines at the one value served here
    kv_cache_dtype: str = "auto"  # the KV cache is kept in the model's dtype
    tokenizer_mode: str = "auto"  # the tokenizer's fast (tokenizers) implementation

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        from omniinfer.checkpoint_config import load_model_config

        _check_int("seed", self.seed, minimum=0)
        for name, why in (("kv_cache_dtype", "the KV cache is kept in the model's dtype"),
                          ("tokenizer_mode", "the fast (tokenizers) tokenizer is used")):
            if getattr(self, name) != "auto":
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; allowed: 'auto' ({why})")
        _check_int("block_size", self.block_size, minimum=1)
        _check_int("max_logprobs", self.max_logprobs, minimum=-1)
        model = load_model_config(self.model, tokenizer=self.tokenizer, dtype=self.dtype,
                                  max_model_len=self.max_model_len, seed=self.seed,
                                  quantization=self.quantization)
        model.trust_remote_code = bool(self.trust_remote_code)
        model.max_logprobs = (model.vocab_size if self.max_logprobs == -1
                              else min(self.max_logprobs, model.vocab_size))
        speculative = self._speculative_config(model)
        steps = 1 if self.num_scheduler_steps is None else self.num_scheduler_steps
        if speculative is not None and steps != 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps!r} with a speculative model "
                             f"({speculative.draft.model!r}): multi-step decoding and speculative "
                             "decoding cannot be combined; use num_scheduler_steps=1")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = max(2048, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                budget = max(budget, model.max_model_len)
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            worker_cls=self.worker_cls,
        )
        check_parallel_sizes(model, parallel)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                swap_space=self.swap_space,
                enable_prefix_caching=bool(self.enable_prefix_caching),
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=model.max_model_len,
                enable_chunked_prefill=bool(self.enable_chunked_prefill),
                preemption_mode=self.preemption_mode,
                num_lookahead_slots=speculative.num_speculative_tokens if speculative else 0,
                num_scheduler_steps=steps,
            ),
            parallel=parallel,
            device=DeviceConfig(device=self.device, attention_backend=self.attention_backend,
                                enforce_eager=bool(self.enforce_eager)),
            speculative=speculative,
        )

    def _speculative_fields(self) -> tuple[str | None, int | None]:
        """(speculative_model, num_speculative_tokens), from vLLM's `speculative_config` dict
        when that is given (a draft model is the one method here)."""
        spec = self.speculative_config
        if spec is None:
            return self.speculative_model, self.num_speculative_tokens
        if not isinstance(spec, dict):
            raise TypeError(f"speculative_config must be a dict such as {{'model': PATH, "
                            f"'num_speculative_tokens': K}}, got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"speculative_config holds {', '.join(map(repr, unknown))}; allowed keys: "
                             f"{', '.join(SPECULATIVE_CONFIG_KEYS)} (a draft model is the one method here)")
        method = spec.get("method")
        if method not in (None, "draft_model"):
            raise ValueError(f"speculative_config method={method!r} is not supported; the one method "
                             "here is 'draft_model' (give 'model': a checkpoint sharing the target's "
                             "vocabulary)")
        tp = spec.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"speculative_config draft_tensor_parallel_size={tp!r} is not supported; "
                             "the draft runs on the driver alone (1)")
        if self.speculative_model is not None or self.num_speculative_tokens is not None:
            raise ValueError("give speculative_config or speculative_model / num_speculative_tokens, "
                             "not both")
        return spec.get("model"), spec.get("num_speculative_tokens")

    def _speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        path, k = self._speculative_fields()
        if path is None and k is None:
            return None
        if path is None or k is None:
            raise ValueError(f"speculative_model={path!r} and num_speculative_tokens={k!r}: give both "
                             "or neither (speculative_config: 'model' and 'num_speculative_tokens')")
        _check_int("num_speculative_tokens", k, minimum=1)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k} is not allowed; it must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}")
        from omniinfer.checkpoint_config import load_model_config

        draft = load_model_config(path, tokenizer=None, dtype=target.dtype,
                                  max_model_len=None, seed=self.seed)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_model={path!r} has vocab_size="
                             f"{draft.vocab_size} but the target model has {target.vocab_size}; the "
                             "draft must share the target's tokenizer and vocabulary")
        if draft.max_model_len < target.max_model_len:
            raise ValueError(f"speculative_model={path!r} supports "
                             f"{draft.max_model_len} positions, fewer than max_model_len="
                             f"{target.max_model_len}; lower max_model_len")
        draft.max_model_len = target.max_model_len
        return SpeculativeConfig(draft=draft, num_speculative_tokens=k)
