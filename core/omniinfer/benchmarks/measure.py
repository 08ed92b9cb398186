"""What the performance workloads measure with: the shapes, model FLOPs and bytes, the machine's
matmul peak and memory bandwidth, and one engine's runs (ours, transformers'), taken in turns.

Used by `omniinfer.benchmarks.perf` (the throughput and latency workloads).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import time

import torch

SHAPES = {
    # Llama shape from the performance issue
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024, vocab_size=32000, arch="llama"),
    # shaped like Qwen2.5-0.5B
    "medium": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, arch="qwen2", tie_word_embeddings=True),
    # Llama-3.2-1B's widths, 8 of its 16 layers: every row a whole number of K-quant blocks, so a
    # q4_k_m file is the Q4_K / Q6_K mix a downloaded 1B-8B file is (medium's 896 columns fall
    # back to Q5_0 and Q8_0, as a downloaded Qwen2.5-0.5B q4_k_m file does)
    "1b-8l": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, arch="llama", tie_word_embeddings=True),
    # Qwen3-30B-A3B's widths (head_dim 128, 8 experts of 768 a token), 8 of its 48 layers, 16 of
    # its 128 experts (a token reads 8 a layer whatever the count) and a 32k vocabulary: a token
    # reads the experts mostly, as the whole model's tokens do
    "a3b-8l": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=16,
                   num_experts_per_tok=8, norm_topk_prob=True, vocab_size=32000, arch="qwen3_moe"),
    # Qwen3-0.6B whole (head_dim 128 over 16 heads, its per-head q/k norms): the dense Qwen3
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, arch="qwen3",
                       tie_word_embeddings=True),
    # for the CI smoke test of the scripts: every code path, seconds to run
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, arch="llama"),
    # a one-layer model of the small vocabulary (host-overhead runs swap its forward out)
    "trivial": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=128, vocab_size=32000, arch="llama"),
}

DEFAULT_WORKLOADS = {"small": (64, 128, 128), "medium": (32, 128, 64)}  # N, input, output
# how long the matmul peak is measured (`matmul_peak`'s arguments) where the default 4 x 0.25 s
# per case is more than a shape needs: the scripts' own smoke tests want a rough peak, quickly
PEAK_BUDGETS = {"tiny": dict(seconds=0.05, rounds=1)}


MAX_MODEL_LEN = 2048  # the checkpoints' context and the engines' max_model_len


def machine() -> dict:
    """The machine a figure comes from: the CPU (model, x86 family/model, cores) and the selected
    platform's run-time facts (for the CPU plugin: the ISA level its kernels run at)."""
    from omniinfer.platforms.host import cpu_info
    from omniinfer.platforms.registry import get_registry

    info = cpu_info()
    out = {"cpu": info["model"] or info["machine"], "usable_cpus": info["usable_cpus"]}
    if "cpu_family" in info:
        out["cpu_family_model"] = f"{info['cpu_family']}/{info.get('model_number', '?')}"
    # torch's own ISA (ATEN_CPU_CAPABILITY caps it, as ONEDNN_MAX_CPU_ISA caps oneDNN's bf16)
    out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    out["onednn_bf16"] = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    try:
        platform = get_registry().select_platform(None)
        out["platform"] = platform.name
        out.update({k: v for k, v in platform.runtime_info().items() if not isinstance(v, dict)})
    except Exception as e:  # a benchmark must not fail on the report
        out["platform_error"] = f"{type(e).__name__}: {e}"
    return out


def machine_line(m: dict | None = None) -> str:
    m = m or machine()
    family = f" (family/model {m['cpu_family_model']})" if "cpu_family_model" in m else ""
    facts = [f"{k.replace('_', ' ')} {m[k]}" for k in ("platform", "cpu_kernels", "torch_cpu_capability",
                                                       "onednn_bf16") if k in m]
    return f"machine: {m['cpu']}{family}, {m['usable_cpus']} CPUs; " + "; ".join(facts)


def build_random_checkpoint(path: str, shape: str, dtype: str = "float32") -> str:
    """A randomly initialised checkpoint of `shape` (with the tiny test tokenizer) at `path`."""
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    return build_tiny_checkpoint(path, arch, dtype=dtype, max_position_embeddings=MAX_MODEL_LEN,
                                 initializer_range=0.02, **spec)


def model_flops(shape: dict, num_prompts: int, input_len: int, output_len: int) -> float:
    """Model FLOPs of the workload: linear layers for every token, the LM head only where
    logits are needed (the last prompt token and every generated one but the last), and
    attention (QK^T and PV) over each token's context."""
    h, layers, heads, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["vocab_size"]
    head = shape.get("head_dim") or h // heads
    per_layer = layer_params(shape)
    tokens = num_prompts * (input_len + output_len - 1)  # the last sampled token is never fed back
    linear = 2 * per_layer * layers * tokens
    lm_head = 2 * h * vocab * num_prompts * output_len
    # context seen by each token: positions 1..input_len+output_len-1
    total_ctx = sum(range(1, input_len + output_len))
    attention = 4 * heads * head * layers * num_prompts * total_ctx
    return float(linear + lm_head + attention)


def weight_bytes(shape: dict, dtype: torch.dtype) -> int:
    """Bytes read per decoded token: every linear weight plus the LM head (tied or not)."""
    params = layer_params(shape) * shape["num_hidden_layers"] + shape["hidden_size"] * shape["vocab_size"]
    return params * torch.empty((), dtype=dtype).element_size()


def layer_params(shape: dict) -> int:
    """A layer's linear weights one token goes through (of a mixture of experts: its router and
    the experts it is routed to)."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head = shape.get("head_dim") or h // heads
    mlp = 3 * h * shape["intermediate_size"]
    if shape.get("num_experts_per_tok"):
        mlp = 3 * h * shape["moe_intermediate_size"] * shape["num_experts_per_tok"] + h * shape["num_experts"]
    return h * (heads + 2 * kv) * head + heads * head * h + mlp


def matmul_peak(shape: dict, dtype: torch.dtype, rows: list[int], seconds: float = 0.25,
                rounds: int = 4) -> float:
    """Best GFLOP/s of x @ W over the workload's linear shapes (W stored [out, in]): `rounds`
    passes over the shapes, `seconds` per shape each. The best window counts (noise on this
    machine only ever lowers a window); one short window per shape read 5-15% low at times."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    cases = [(torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype))
             for m in rows for k, n in ((h, 2 * inter), (inter, h), (h, vocab))]
    best = 0.0
    for _ in range(rounds):
        for x, w in cases:
            torch.nn.functional.linear(x, w)
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                torch.nn.functional.linear(x, w)
                count += 1
            flops = 2 * x.shape[0] * x.shape[1] * w.shape[0] * count
            best = max(best, flops / (time.perf_counter() - t0) / 1e9)
    return best


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """GB/s of a torch copy (bytes read + written) and of a sum (bytes read)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    copies, sums = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * num_bytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        src.sum()
        sums.append(num_bytes / (time.perf_counter() - t0) / 1e9)
    return {"copy_gbps": statistics.median(copies), "read_gbps": statistics.median(sums)}


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_model_len(path: str) -> int:
    """The engines' max_model_len for a checkpoint: MAX_MODEL_LEN, or the model's own context
    where that is shorter (a --model of 512 positions)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):  # (a GGUF file: the benchmarks write it from a checkpoint)
        return MAX_MODEL_LEN
    with open(config, encoding="utf-8") as f:
        return min(MAX_MODEL_LEN, json.load(f).get("max_position_embeddings") or MAX_MODEL_LEN)


def omniinfer_runs(path: str, prompts, output_len: int, dtype: str, engine_args: list[dict]):
    """One engine per entry of `engine_args`, built and warmed up; returns ([run per engine],
    close). A run generates the whole workload and returns its seconds."""
    from omniinfer import LLM, SamplingParams

    llms = [LLM(path, dtype=dtype, max_num_seqs=len(prompts),
                max_model_len=engine_model_len(path), **args)
            for args in engine_args]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for llm in llms:
        llm.generate(requests[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def runner(llm):
        def run() -> float:
            t0 = time.perf_counter()
            outs = llm.generate(requests, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
            return elapsed
        return run

    def close() -> None:
        for llm in llms:
            llm.llm_engine.shutdown()

    return [runner(llm) for llm in llms], close


class SkippedRun(Exception):
    """A configuration that cannot run here (its reason is the message): reported, not fatal."""


def transformers_runs(path: str, prompts, output_len: int, dtype: torch.dtype,
                      batches: list[int]) -> dict:
    """transformers on the same workload, warmed up: {"static_<b>": run} for each batch size b
    (`generate` on consecutive batches of b prompts) and "continuous" (`generate_batch`, where the
    installed version has it). One model serves them all (continuous batching leaves it as it
    was: checked, same tokens and times after it).

    Continuous batching gets a KV cache of the size omniinfer's engine may use, every prompt at
    MAX_MODEL_LEN tokens: left to itself on the CPU it takes 60-90% of the machine's memory
    (14.5 GB here), and runs slower with it (29.5 s against 18.7 for the small fp32 workload)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)

    def static(batch: int):
        def run() -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                for i in range(0, len(prompts), batch):
                    chunk = ids[i:i + batch]
                    out = model.generate(chunk, attention_mask=torch.ones_like(chunk),
                                         max_new_tokens=output_len, min_new_tokens=output_len,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
                    assert out.shape[1] == chunk.shape[1] + output_len
            return time.perf_counter() - t0
        return run

    def cache_size() -> dict:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:  # older versions size their cache from generation_config alone
            return {}
        cb = ContinuousBatchingConfig()  # a new one each run: the run writes what it inferred
        cb.num_blocks = -(-len(prompts) * MAX_MODEL_LEN // cb.page_size)
        return {"continuous_batching_config": cb}

    def continuous(config, inputs):
        def run() -> float:
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False,
                                         **cache_size())
            except MemoryError as e:  # it sizes against the memory free at that moment
                raise SkippedRun(f"transformers refused the KV cache omniinfer gets: {e}") from None
            return time.perf_counter() - t0
        return run

    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
    runs = {f"static_{b}": static(b) for b in batches}
    if hasattr(model, "generate_batch"):
        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
        warm = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        try:
            continuous(warm, prompts[:2])()
            runs["continuous"] = continuous(config, prompts)
        except SkippedRun as e:
            runs["continuous"] = e
    return runs



COMPARISONS = ("transformers", "llama.cpp")


def comparisons(compare) -> set[str]:
    """`compare` (None, a name, or several) as a set, each checked."""
    names = set() if not compare else {compare} if isinstance(compare, str) else set(compare)
    unknown = sorted(names - set(COMPARISONS))
    if unknown:
        raise ValueError(f"compare={unknown[0]!r}: expected one of {', '.join(COMPARISONS)}")
    return names


def take_turns(runs: dict, repeats: int) -> dict[str, list | SkippedRun]:
    """`repeats` rounds; each round runs every configuration once, so that a change in the
    machine's load between rounds hits them alike, starting one further along each round, so
    that none always runs right after the same other (in fixed order, omniinfer's multi-step
    engine, always first after transformers' runs, came out slower than its one-step engine,
    the reverse of a rotated comparison). {name: what its run returned, by round}.
    A configuration that raises SkippedRun (or is one) leaves the rotation; its entry becomes the
    SkippedRun, whose message says why."""
    times: dict[str, list | SkippedRun] = {name: [] for name in runs}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if isinstance(times[name], SkippedRun):
                continue
            if isinstance(runs[name], SkippedRun):
                times[name] = runs[name]
                continue
            try:
                times[name].append(runs[name]())
            except SkippedRun as e:
                times[name] = e
    return times


def read_bandwidth(num_bytes: int = 1 << 28) -> float:
    """GB/s of one torch sum over `num_bytes` (bytes read): a round's reading of the machine."""
    src = torch.ones(num_bytes // 4)
    src.sum()
    t0 = time.perf_counter()
    src.sum()
    return num_bytes / (time.perf_counter() - t0) / 1e9


def omniinfer_latency_run(path: str, prompt: list[int], output_len: int, dtype: str):
    """An engine built and warmed up; returns (run, close). A run serves one request and returns
    (seconds to the first token, seconds per later token)."""
    from omniinfer import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=engine_model_len(path))
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    count = itertools.count()

    def run() -> tuple[float, float]:
        engine.add_request(f"lat{next(count)}", {"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        # the prefill step samples the first token; then one step per token, or several per
        # step with multi-step decoding (the LLM default)
        return stamps[0] - t0, (stamps[-1] - stamps[0]) / (output_len - 1)

    return run, engine.shutdown


def transformers_latency_run(path: str, prompt: list[int], output_len: int, dtype: torch.dtype):
    """transformers' `generate` on the same request, warmed up; a run returns (seconds to the
    first token, seconds per later token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)

    def run() -> tuple[float, float]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kwargs)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            total = time.perf_counter() - t0
        return ttft, (total - ttft) / (output_len - 1)

    return run
