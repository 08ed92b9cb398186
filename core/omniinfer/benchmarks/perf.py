"""The issue-8 performance workloads: shapes, model FLOPs and bytes, the machine's matmul peak
and memory bandwidth, our engine and transformers on the same checkpoint and workload.

Behind `benchmarks/throughput.py`, `benchmarks/latency.py` and `omniinfer bench throughput |
latency --shape ...`. Every function returns plain dicts; the callers print and save them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile

import torch

from omniinfer.benchmarks.measure import (  # noqa: F401 - re-exported: the scripts import them here
    COMPARISONS,
    DEFAULT_WORKLOADS,
    MAX_MODEL_LEN,
    PEAK_BUDGETS,
    SHAPES,
    SkippedRun,
    build_random_checkpoint,
    comparisons,
    copy_bandwidth,
    machine,
    machine_line,
    make_prompts,
    matmul_peak,
    model_flops,
    omniinfer_latency_run,
    omniinfer_runs,
    read_bandwidth,
    take_turns,
    transformers_latency_run,
    transformers_runs,
    weight_bytes,
)


def shape_of(model_dir: str) -> dict:
    """The shape keys of a checkpoint's config.json (for FLOPs and bytes of any model)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "head_dim", "moe_intermediate_size", "num_experts_per_tok")
    shape = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts and cfg.get("num_experts_per_tok"):
        shape["num_experts"] = experts
        shape.setdefault("moe_intermediate_size", cfg["intermediate_size"])  # (Mixtral's experts)
    shape.setdefault("num_key_value_heads", shape["num_attention_heads"])
    return shape


def throughput(shape_name: str | None, dtype: str, num_prompts: int | None = None,
               input_len: int | None = None, output_len: int | None = None,
               compare: str | None = None, model: str | None = None,
               max_num_batched_tokens: int = 2048, repeats: int = 1,
               num_scheduler_steps: int | None = None, llama_cpp_bin: str | None = None,
               gguf: str | None = None) -> dict:
    """N random prompts at once through LLM.generate; MFU against the measured matmul peak;
    with compare="transformers", transformers' best static batch and continuous batching.
    num_scheduler_steps defaults to the LLM class's (8); above 1 (multi-step decoding)
    omniinfer also runs with one step per schedule, as "omniinfer_single_step". Every timed
    configuration (each engine, each of transformers' batch sizes, its continuous batching) is
    built and warmed up first (and run once on the whole workload, untimed), then all run in
    turns, `repeats` rounds of one run each, so that
    the ratios compare runs made minutes, not a quarter of an hour, apart; each reports its
    median run, and the runs are kept under "runs_s". With gguf="q4_0" (a gguf_export file type)
    omniinfer and llama.cpp run that GGUF file (transformers is left out)."""
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

        file = None
        if gguf is not None:
            from omniinfer.benchmarks.gguf_export import export

            file = export(path, os.path.join(tmp, f"model-{gguf}.gguf"), gguf)
            compare = [c for c in compare if c != "transformers"]
        steps = [num_scheduler_steps] + ([1] if num_scheduler_steps > 1 else [])
        engines, close = omniinfer_runs(file or path, prompts, o, "float32" if file else dtype, [
            {"max_num_batched_tokens": max_num_batched_tokens, "num_scheduler_steps": k} for k in steps])
        try:
            runs = {f"omniinfer_{k}": run for k, run in zip(steps, engines)}
            batches = [b for b in (8, 32, 64) if b <= n] or [n]
            if "transformers" in compare:
                runs.update(transformers_runs(path, prompts, o, torch_dtype, batches))
            if "llama.cpp" in compare:
                runs["llama.cpp"] = _llama_cpp(lambda lc: lc.throughput_run(
                    lc.tool("llama-batched-bench", llama_cpp_bin), file or lc.gguf_of(path, dtype, tmp), n, i, o,
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
            "shape": shape_name or os.path.basename(os.path.normpath(path)),
            "dtype": dtype if gguf is None else f"gguf {gguf}", "machine": machine(), "num_prompts": n, "input_len": i, "output_len": o, "repeats": repeats,
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
    if str(r.get("dtype", "")).startswith("gguf"):
        lines.append("  (MFU: against torch's float32 matmul peak; a GGUF file's products run int8 dots or "
                     "bfloat16 tiles, which can pass it)")
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
            llama_cpp_bin: str | None = None, gguf: str | None = None, fp8: bool = False) -> dict:
    """One request at a time: TTFT, ms per output token, the weight bandwidth that implies and
    the copy/read bandwidth measured first; with compare="transformers", the same for it.

    Batch-1 decode follows the machine's memory bandwidth, which drifts by up to 2x within
    minutes here, so the engines take turns, one request each per round, and a sum's read
    bandwidth is measured in each round as well ("read_gbps_rounds"). The weight bandwidth is the
    checkpoint's weight bytes over the time a token takes: an engine that reads fewer bytes a
    token (the CPU plugin's greedy LM head reads an int8 copy) can show more than the read
    bandwidth, and beat the floor, the weights alone at that bandwidth.

    With gguf="q4_k_m" (a gguf_export file type), the checkpoint is written as that GGUF file and
    every engine runs the file (transformers would dequantise it to a float model: left out); the
    weight bytes are then the file's tensors a token reads.

    With fp8=True, the checkpoint is written as an FP8 one (quant_method fp8, e4m3 with a scale
    per 128 x 128 block, as Qwen3-*-FP8) and omniinfer runs that; transformers, where compared,
    reads the same files (it dequantises them on a CPU); the weight bytes are its tensors a token
    reads. llama.cpp has no FP8 type: left out."""
    if output_len < 2:
        raise ValueError(f"output_len={output_len!r}: ms per output token needs at least 2 tokens")
    compare = comparisons(compare)
    torch_dtype = getattr(torch, dtype)
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        path = model or build_random_checkpoint(os.path.join(tmp, shape_name), shape_name, dtype)
        shape = shape_of(path)
        prompt = make_prompts(1, input_len, shape["vocab_size"])[0]
        result = {"shape": shape_name or os.path.basename(os.path.normpath(path)),
                  "dtype": dtype if gguf is None else f"gguf {gguf}",
                  "machine": machine(), "input_len": input_len, "output_len": output_len,
                  "threads": torch.get_num_threads(), **bandwidth,
                  "weight_bytes": weight_bytes(shape, torch_dtype)}
        file = None
        if fp8:
            if gguf is not None:
                raise ValueError("fp8=True with gguf: one quantised copy at a time")
            from omniinfer.testing.quant_checkpoints import Scheme, write_quantized

            float_path = path
            path = write_quantized(path, os.path.join(tmp, "fp8"), Scheme("fp8", block=(128, 128)))
            result["dtype"] = f"fp8 e4m3 b128, {dtype} activations"
            result["weight_bytes"] = safetensors_bytes_per_token(path)
            compare = [c for c in compare if c != "llama.cpp"]
        if gguf is not None:
            from omniinfer.benchmarks.gguf_export import export

            file = export(path, os.path.join(tmp, f"model-{gguf}.gguf"), gguf)
            result["weight_bytes"] = gguf_bytes_per_token(file)
            from omniinfer.benchmarks import resident

            result["memory"] = {**resident.measure(file), "file_bytes": os.path.getsize(file)}
        ours, close = omniinfer_latency_run(file or path, prompt, output_len, "float32" if file else dtype)
        closers = [close]
        try:
            runs = {"omniinfer": ours}
            if fp8:  # the float checkpoint it was made from, in the same dtype, in turns with it
                runs["omniinfer float"], close_float = omniinfer_latency_run(float_path, prompt, output_len, dtype)
                closers.append(close_float)
            if "transformers" in compare:
                runs["transformers"] = (SkippedRun("transformers dequantises a GGUF file to a float model")
                                        if file else transformers_latency_run(path, prompt, output_len, torch_dtype))
            if "llama.cpp" in compare:
                runs["llama.cpp"] = _llama_cpp(lambda lc: lc.latency_run(
                    lc.tool("llama-bench", llama_cpp_bin), file or lc.gguf_of(path, dtype, tmp), input_len,
                    output_len, torch.get_num_threads()))
            runs["read"] = read_bandwidth
            rounds = take_turns(runs, repeats)
        finally:
            for close in closers:
                close()
    result["read_gbps_rounds"] = rounds.pop("read")
    # what reading the weights alone takes at the rounds' read bandwidth: batch-1 decode's floor
    result["read_bound_ms_per_token"] = result["weight_bytes"] / statistics.median(result["read_gbps_rounds"]) / 1e6
    if fp8:
        result["float_weight_bytes"] = weight_bytes(shape, torch_dtype)
    for name, times in list(rounds.items()):
        if isinstance(times, SkippedRun):
            result[name] = {"skipped": str(times)}
            del rounds[name]
            continue
        nbytes = result["float_weight_bytes"] if name == "omniinfer float" else result["weight_bytes"]
        result[name] = {"ttft_ms": 1e3 * statistics.median(t for t, _ in times),
                        "ms_per_token": 1e3 * statistics.median(p for _, p in times),
                        "ms_per_token_rounds": [1e3 * p for _, p in times]}
        result[name]["weight_gbps"] = nbytes / result[name]["ms_per_token"] / 1e6
        # its weight bandwidth against the sum's in the same round
        result[name]["read_fraction"] = statistics.median(
            nbytes / p / 1e6 / read
            for p, read in zip(result[name]["ms_per_token_rounds"], result["read_gbps_rounds"]))
    for name in ("transformers", "llama.cpp", "omniinfer float"):
        if name in rounds:
            key = {"transformers": "speedup_rounds", "llama.cpp": "speedup_rounds_llama_cpp",
                   "omniinfer float": "speedup_rounds_float"}[name]
            result[key] = [t / o for t, o in zip(result[name]["ms_per_token_rounds"],
                                                 result["omniinfer"]["ms_per_token_rounds"])]
    return result


def safetensors_bytes_per_token(path: str) -> int:
    """The bytes of a checkpoint directory's tensors one decoded token reads: all but the
    embedding table where the LM head has its own weight."""
    import glob

    from safetensors import safe_open

    sizes = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                t = f.get_slice(name)
                sizes[name] = t.get_shape(), t.get_dtype()
    bytes_of = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "U8": 1}
    total = 0
    for name, (shape, dtype) in sizes.items():
        if name.endswith("embed_tokens.weight") and "lm_head.weight" in sizes:
            continue
        n = 1
        for d in shape:
            n *= d
        total += n * bytes_of[dtype]
    return total


def gguf_bytes_per_token(path: str) -> int:
    """The bytes of a GGUF file's tensors one decoded token reads: all but the embedding table,
    which the LM head reads whole where it is tied (no output.weight); of a mixture of experts'
    stacks, the experts a token is routed to (expert_used_count of expert_count)."""
    from omniinfer.quantization.gguf_file import GGUFFile
    from omniinfer.quantization.gguf_moe import is_stack

    file = GGUFFile(path)
    tensors = file.tensor_bytes()
    routed = 1.0
    if file.field(f"{file.arch}.expert_count"):
        routed = file.field(f"{file.arch}.expert_used_count") / file.field(f"{file.arch}.expert_count")
    return int(sum(n * (routed if is_stack(name) else 1) for name, n in tensors.items()
                   if not (name == "token_embd.weight" and "output.weight" in tensors)))


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
    for name in ("omniinfer", "omniinfer float", "transformers", "llama.cpp"):
        if name in r and "skipped" in r[name]:
            lines.append(f"  {name:<15} skipped: {r[name]['skipped']}")
        elif name in r:
            x = r[name]
            lines.append(f"  {name:<15} TTFT {x['ttft_ms']:8.1f} ms  {x['ms_per_token']:7.2f} ms/token  "
                         f"weights at {x['weight_gbps']:5.1f} GB/s ({100 * x['read_fraction']:.0f}% of the "
                         f"round's read)")
    bound = r["read_bound_ms_per_token"]
    lines.append(f"  the weights alone at the rounds' median read bandwidth: {bound:7.2f} ms/token")
    for name, key in (("omniinfer float", "speedup_rounds_float"), ("transformers", "speedup_rounds"),
                      ("llama.cpp", "speedup_rounds_llama_cpp")):
        if key in r:
            ratios = r[key]
            lines.append(f"  decode speed-up over {name}: "
                         f"{r[name]['ms_per_token'] / r['omniinfer']['ms_per_token']:.2f}x"
                         f" (round by round {min(ratios):.2f}-{max(ratios):.2f}x; the floor would be "
                         f"{r[name]['ms_per_token'] / bound:.2f}x)")
    if "ttft_ms" in r.get("llama.cpp", {}):
        lines.append(f"  prompt of {r['input_len']}: omniinfer's TTFT is "
                     f"{r['omniinfer']['ttft_ms'] / r['llama.cpp']['ttft_ms']:.2f}x llama.cpp's prompt time")
    mem = r.get("memory") or {}
    if mem.get("file_bytes"):
        held, file, kv = mem["model_bytes"], mem["file_bytes"], mem["kv_cache_bytes"]
        lines.append(f"  resident memory (a fresh process): weights held {held / 1e6:.0f} MB = {held / file:.2f}x the "
                     f"file's {file / 1e6:.0f} MB; the process grew {mem['rss_growth_bytes'] / 1e6:.0f} MB = "
                     f"{mem['rss_growth_bytes'] / (file + kv):.2f}x the file plus its KV cache ({kv / 1e6:.0f} MB)"
                     + (f", its own data (anonymous memory) {mem['anon_growth_bytes'] / 1e6:.0f} MB = "
                        f"{mem['anon_growth_bytes'] / (file + kv):.2f}x" if "anon_growth_bytes" in mem else "")
                     + (f"; its tokenizer alone {mem['tokenizer_rss_bytes'] / 1e6:.0f} MB"
                        if "tokenizer_rss_bytes" in mem else ""))
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
