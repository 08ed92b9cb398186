"""The issue-8 performance workloads: shapes, model FLOPs and bytes, the machine's matmul peak
and memory bandwidth, our engine and transformers on the same checkpoint and workload.

Behind `benchmarks/throughput.py`, `benchmarks/latency.py` and `omniinfer bench throughput |
latency --shape ...`. Every function returns plain dicts; the callers print and save them.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

import torch

SHAPES = {
    # Llama shape from the performance issue
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024, vocab_size=32000, arch="llama"),
    # shaped like Qwen2.5-0.5B
    "medium": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, arch="qwen2", tie_word_embeddings=True),
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
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head = h // heads
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]
    per_layer = h * (heads + 2 * kv_heads) * head + heads * head * h + 3 * h * inter
    tokens = num_prompts * (input_len + output_len - 1)  # the last sampled token is never fed back
    linear = 2 * per_layer * layers * tokens
    lm_head = 2 * h * vocab * num_prompts * output_len
    # context seen by each token: positions 1..input_len+output_len-1
    total_ctx = sum(range(1, input_len + output_len))
    attention = 4 * heads * head * layers * num_prompts * total_ctx
    return float(linear + lm_head + attention)


def weight_bytes(shape: dict, dtype: torch.dtype) -> int:
    """Bytes read per decoded token: every linear weight plus the LM head (tied or not)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head = h // heads
    per_layer = h * (heads + 2 * kv) * head + heads * head * h + 3 * h * shape["intermediate_size"]
    params = per_layer * layers + h * shape["vocab_size"]
    return params * torch.empty((), dtype=dtype).element_size()


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


def omniinfer_runs(path: str, prompts, output_len: int, dtype: str, engine_args: list[dict]):
    """One engine per entry of `engine_args`, built and warmed up; returns ([run per engine],
    close). A run generates the whole workload and returns its seconds."""
    from omniinfer import LLM, SamplingParams

    llms = [LLM(path, dtype=dtype, max_num_seqs=len(prompts),
                max_model_len=MAX_MODEL_LEN, **args)
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

    llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
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


def shape_of(model_dir: str) -> dict:
    """The shape keys of a checkpoint's config.json (for FLOPs and bytes of any model)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size")
    shape = {k: cfg[k] for k in keys if k in cfg}
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    return shape


def throughput(shape_name: str | None, dtype: str, num_prompts: int | None = None,
               input_len: int | None = None, output_len: int | None = None,
               compare: str | None = None, model: str | None = None,
               max_num_batched_tokens: int = 2048, repeats: int = 1,
               num_scheduler_steps: int | None = None, llama_cpp_bin: str | None = None) -> dict:
    """N random prompts at once through LLM.generate; MFU against the measured matmul peak;
    with compare="transformers", transformers' best static batch and continuous batching.
    num_scheduler_steps defaults to the LLM class's (8); above 1 (multi-step decoding)
    omniinfer also runs with one step per schedule, as "omniinfer_single_step". Every timed
    configuration (each engine, each of transformers' batch sizes, its continuous batching) is
    built and warmed up first (and run once on the whole workload, untimed), then all run in
    turns, `repeats` rounds of one run each, so that
    the ratios compare runs made minutes, not a quarter of an hour, apart; each reports its
    median run, and the runs are kept under "runs_s"."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected a positive number of runs")
    compare = comparisons(compare)
    if num_scheduler_steps is None:
        from omniinfer.entrypoints.llm import OFFLINE_SCHEDULER_STEPS

        num_scheduler_steps = OFFLINE_SCHEDULER_STEPS
    n, i, o = DEFAULT_WORKLOADS.get(shape_name or "", (64, 128, 128))
    n, i, o = num_prompts or n, input_len or i, output_len or o
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = model or build_random_checkpoint(os.path.join(tmp, shape_name), shape_name, dtype)
        shape = shape_of(path)
        prompts = make_prompts(n, i, shape["vocab_size"])
        peak = matmul_peak(shape, torch_dtype, [n, max_num_batched_tokens],
                           **PEAK_BUDGETS.get(shape_name or "", {}))
        flops = model_flops(shape, n, i, o)

        steps = [num_scheduler_steps] + ([1] if num_scheduler_steps > 1 else [])
        engines, close = omniinfer_runs(path, prompts, o, dtype, [
            {"max_num_batched_tokens": max_num_batched_tokens, "num_scheduler_steps": k} for k in steps])
        try:
            runs = {f"omniinfer_{k}": run for k, run in zip(steps, engines)}
            batches = [b for b in (8, 32, 64) if b <= n] or [n]
            if "transformers" in compare:
                runs.update(transformers_runs(path, prompts, o, torch_dtype, batches))
            if "llama.cpp" in compare:
                runs["llama.cpp"] = _llama_cpp(lambda lc: lc.throughput_run(
                    lc.tool("llama-batched-bench", llama_cpp_bin), lc.gguf_of(path, dtype, tmp), n, i, o,
                    torch.get_num_threads()))
            # one round untimed: an engine's first run of the whole workload is the slow one
            # (bf16 on the small shape: 1.52 s, then 1.13-1.16), after warm-ups of 2 prompts
            take_turns(runs, 1)
            times = take_turns(runs, repeats)
        finally:
            close()

        def ours(seconds: list[float]) -> dict:
            elapsed = statistics.median(seconds)
            return {"seconds": elapsed, "runs_s": seconds, "requests_per_s": n / elapsed,
                    "output_tokens_per_s": n * o / elapsed, "total_tokens_per_s": n * (i + o) / elapsed,
                    "model_gflops": flops / elapsed / 1e9, "mfu": flops / elapsed / 1e9 / peak}

        result = {
            "shape": shape_name or os.path.basename(os.path.normpath(path)), "dtype": dtype,
            "machine": machine(), "num_prompts": n, "input_len": i, "output_len": o, "repeats": repeats,
            "num_scheduler_steps": num_scheduler_steps,
            "threads": torch.get_num_threads(), "matmul_peak_gflops": peak,
            "omniinfer": ours(times[f"omniinfer_{steps[0]}"]),
        }
        if len(steps) > 1:
            result["omniinfer_single_step"] = ours(times["omniinfer_1"])
        if "llama.cpp" in compare:
            result["llama_cpp"] = ({"skipped": str(times["llama.cpp"])} if isinstance(times["llama.cpp"], SkippedRun)
                                   else {**ours(times["llama.cpp"]), "tool": "llama-batched-bench"})
        if "transformers" in compare:
            static = {b: statistics.median(times[f"static_{b}"]) for b in batches}
            best = min(static, key=static.get)
            result["transformers_static"] = {"best_batch": best, "seconds": static[best],
                                             "runs_s": times[f"static_{best}"],
                                             "output_tokens_per_s": n * o / static[best],
                                             "all_batches_s": static}
            if isinstance(times.get("continuous"), SkippedRun):
                result["transformers_continuous"] = {"skipped": str(times["continuous"])}
            elif "continuous" in times:
                cont = statistics.median(times["continuous"])
                result["transformers_continuous"] = {"seconds": cont, "runs_s": times["continuous"],
                                                     "output_tokens_per_s": n * o / cont}
    return result


def throughput_table(r: dict) -> str:
    runs = f"  median of {r['repeats']} runs" if r.get("repeats", 1) > 1 else ""
    lines = [f"throughput: {r['shape']} {r['dtype']}  N={r['num_prompts']} I={r['input_len']} "
             f"O={r['output_len']}  threads={r['threads']}  matmul peak {r['matmul_peak_gflops']:.0f} GFLOP/s"
             + runs, machine_line(r.get("machine"))]
    e = r["omniinfer"]
    steps = r.get("num_scheduler_steps", 1)
    rows = [(f"omniinfer ({steps} steps)" if steps > 1 else "omniinfer", e)]
    if "omniinfer_single_step" in r:
        rows.append(("omniinfer (1 step)", r["omniinfer_single_step"]))
    for label, x in rows:
        lines.append(f"  {label:<20} {x['output_tokens_per_s']:8.0f} out tok/s  "
                     f"{x['total_tokens_per_s']:8.0f} total tok/s  {x['requests_per_s']:6.2f} req/s  "
                     f"MFU {100 * x['mfu']:5.1f}%")
    for key, label in (("transformers_static", "transformers static"),
                       ("transformers_continuous", "transformers cont."), ("llama_cpp", "llama.cpp")):
        if key in r and "skipped" in r[key]:
            lines.append(f"  {label:<20} skipped: {r[key]['skipped']}")
        elif key in r:
            t = r[key]
            extra = f" (batch {t['best_batch']})" if "best_batch" in t else ""
            lines.append(f"  {label:<20} {t['output_tokens_per_s']:8.0f} out tok/s{extra}  -> omniinfer is "
                         f"{e['output_tokens_per_s'] / t['output_tokens_per_s']:.2f}x")
    return "\n".join(lines)


def latency(shape_name: str | None, dtype: str, input_len: int = 128, output_len: int = 64,
            repeats: int = 3, compare: str | None = None, model: str | None = None,
            llama_cpp_bin: str | None = None) -> dict:
    """One request at a time: TTFT, ms per output token, the weight bandwidth that implies and
    the copy/read bandwidth measured first; with compare="transformers", the same for it.

    Batch-1 decode follows the machine's memory bandwidth, which drifts by up to 2x within
    minutes here, so the engines take turns, one request each per round, and a sum's read
    bandwidth is measured in each round as well ("read_gbps_rounds"). The weight bandwidth is the
    checkpoint's weight bytes over the time a token takes: an engine that reads fewer bytes a
    token (the CPU plugin's greedy LM head reads an int8 copy) can show more than the read
    bandwidth, and beat the floor, the weights alone at that bandwidth."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len!r}: ms per output token needs at least 2 tokens")
    compare = comparisons(compare)
    torch_dtype = getattr(torch, dtype)
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        path = model or build_random_checkpoint(os.path.join(tmp, shape_name), shape_name, dtype)
        shape = shape_of(path)
        prompt = make_prompts(1, input_len, shape["vocab_size"])[0]
        result = {"shape": shape_name or os.path.basename(os.path.normpath(path)), "dtype": dtype,
                  "machine": machine(), "input_len": input_len, "output_len": output_len,
                  "threads": torch.get_num_threads(), **bandwidth,
                  "weight_bytes": weight_bytes(shape, torch_dtype)}
        ours, close = omniinfer_latency_run(path, prompt, output_len, dtype)
        try:
            runs = {"omniinfer": ours}
            if "transformers" in compare:
                runs["transformers"] = transformers_latency_run(path, prompt, output_len, torch_dtype)
            if "llama.cpp" in compare:
                runs["llama.cpp"] = _llama_cpp(lambda lc: lc.latency_run(
                    lc.tool("llama-bench", llama_cpp_bin), lc.gguf_of(path, dtype, tmp), input_len,
                    output_len, torch.get_num_threads()))
            runs["read"] = read_bandwidth
            rounds = take_turns(runs, repeats)
        finally:
            close()
    result["read_gbps_rounds"] = rounds.pop("read")
    # what reading the weights alone takes at the rounds' read bandwidth: batch-1 decode's floor
    result["read_bound_ms_per_token"] = result["weight_bytes"] / statistics.median(result["read_gbps_rounds"]) / 1e6
    for name, times in list(rounds.items()):
        if isinstance(times, SkippedRun):
            result[name] = {"skipped": str(times)}
            del rounds[name]
            continue
        result[name] = {"ttft_ms": 1e3 * statistics.median(t for t, _ in times),
                        "ms_per_token": 1e3 * statistics.median(p for _, p in times),
                        "ms_per_token_rounds": [1e3 * p for _, p in times]}
        result[name]["weight_gbps"] = result["weight_bytes"] / result[name]["ms_per_token"] / 1e6
        # its weight bandwidth against the sum's in the same round
        result[name]["read_fraction"] = statistics.median(
            result["weight_bytes"] / p / 1e6 / read
            for p, read in zip(result[name]["ms_per_token_rounds"], result["read_gbps_rounds"]))
    for name in ("transformers", "llama.cpp"):
        if name in rounds:
            key = "speedup_rounds" if name == "transformers" else "speedup_rounds_llama_cpp"
            result[key] = [t / o for t, o in zip(result[name]["ms_per_token_rounds"],
                                                 result["omniinfer"]["ms_per_token_rounds"])]
    return result


def _llama_cpp(make):
    """make(the llama_cpp module) -> a run, or the SkippedRun saying why there is none."""
    from omniinfer.benchmarks import llama_cpp

    try:
        return make(llama_cpp)
    except SkippedRun as e:
        return e


def latency_table(r: dict) -> str:
    reads = r["read_gbps_rounds"]
    lines = [f"latency: {r['shape']} {r['dtype']}  I={r['input_len']} O={r['output_len']}  threads="
             f"{r['threads']}  copy {r['copy_gbps']:.1f} GB/s, read {r['read_gbps']:.1f} GB/s "
             f"(between runs {min(reads):.1f}-{max(reads):.1f}), weights {r['weight_bytes'] / 1e9:.2f} GB/token",
             machine_line(r.get("machine"))]
    for name in ("omniinfer", "transformers", "llama.cpp"):
        if name in r and "skipped" in r[name]:
            lines.append(f"  {name:<13} skipped: {r[name]['skipped']}")
        elif name in r:
            x = r[name]
            lines.append(f"  {name:<13} TTFT {x['ttft_ms']:8.1f} ms  {x['ms_per_token']:7.2f} ms/token  "
                         f"weights at {x['weight_gbps']:5.1f} GB/s ({100 * x['read_fraction']:.0f}% of the "
                         f"round's read)")
    bound = r["read_bound_ms_per_token"]
    lines.append(f"  the weights alone at the rounds' median read bandwidth: {bound:7.2f} ms/token")
    for name, key in (("transformers", "speedup_rounds"), ("llama.cpp", "speedup_rounds_llama_cpp")):
        if key in r:
            ratios = r[key]
            lines.append(f"  decode speed-up over {name}: "
                         f"{r[name]['ms_per_token'] / r['omniinfer']['ms_per_token']:.2f}x"
                         f" (round by round {min(ratios):.2f}-{max(ratios):.2f}x; the floor would be "
                         f"{r[name]['ms_per_token'] / bound:.2f}x)")
    if "ttft_ms" in r.get("llama.cpp", {}):
        lines.append(f"  prompt of {r['input_len']}: omniinfer's TTFT is "
                     f"{r['omniinfer']['ttft_ms'] / r['llama.cpp']['ttft_ms']:.2f}x llama.cpp's prompt time")
    return "\n".join(lines)


def append_json(path: str, result: dict) -> None:
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = json.load(f)
    rows.append(result)
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)


def unwind_on_sigterm() -> None:
    """Let SIGTERM (`timeout`, `kill`) unwind the stack as Ctrl-C does, so that the temporary
    checkpoints a benchmark builds (up to 2 GB each) are deleted: Python's default for SIGTERM
    ends the process without running `finally` blocks or `with` exits."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def quiet() -> None:
    os.environ.setdefault("OMNIINFER_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
