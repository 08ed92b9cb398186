"""What a loaded model costs in resident memory, measured in a fresh process: `python -m
omniinfer.benchmarks.resident MODEL` prints JSON with the process's resident set before the model
and after loading it and serving one request, the KV cache's bytes and the weights the model
holds; `measure` adds what the model's tokenizer alone costs (another fresh process). A fresh
process, because a benchmark that built a checkpoint first keeps that memory in its heap.

The baseline is the engine with its code imported — the engine, the platform's plugin and model
runner, the tokenizer library: code is the same whatever the model (~50 MB here, most of it
transformers) — so the growth is what this model's data costs: weights, KV cache, tokenizer,
and whatever else loading leaves behind. The growth is given twice: all of it, and the
anonymous part alone (the process's own data: what the model costs), without the pages of the
libraries' files that running the model touched for the first time (code, shared with every
other process that maps them, and dropped by the kernel first under pressure)."""

from __future__ import annotations

import json
import subprocess
import sys

MAX_MODEL_LEN = 2048


def resident_bytes() -> int:
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def anonymous_bytes() -> int:
    """The resident set less the pages of files (the libraries' code and data that running
    touched: ~10 MB of libtorch alone, whatever the model): the process's own data."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def import_engine():
    """The engine's code, imported as loading any model imports it (a platform's kernels load
    with the model: counted)."""
    import transformers  # noqa: F401 - the tokenizers' code (AutoTokenizer and the classes it picks)
    from transformers import AutoTokenizer  # noqa: F401

    import omniinfer.engine.llm_engine  # noqa: F401
    from omniinfer.platforms.registry import select_platform

    select_platform().model_runner_cls()


def tokenizer_main(model: str) -> dict:
    """What loading `model`'s tokenizer alone grows a fresh process by."""
    import_engine()
    from omniinfer.engine.llm_engine import load_tokenizer
    from omniinfer.heap import release_freed_memory

    before = resident_bytes()
    tokenizer = load_tokenizer(model)
    release_freed_memory()  # (as the engine does once it is loaded)
    return {"tokenizer_rss_bytes": resident_bytes() - before, "vocab_size": len(tokenizer)}


def main(model: str, dtype: str) -> dict:
    import_engine()
    from omniinfer import LLM, SamplingParams

    before, before_anon = resident_bytes(), anonymous_bytes()
    llm = LLM(model, dtype=dtype, max_num_seqs=1, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=MAX_MODEL_LEN // 16 + 1)  # one sequence's cache (zero-filled: resident)
    llm.generate({"prompt_token_ids": [1] * 128}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    after, after_anon = resident_bytes(), anonymous_bytes()
    worker = llm.llm_engine.executor.worker
    result = {"baseline_rss_bytes": before, "rss_growth_bytes": after - before,
              "anon_growth_bytes": after_anon - before_anon,
              "kv_cache_bytes": sum(t.numel() * t.element_size() for t in worker.cache_engine.device_cache),
              "model_bytes": worker.model_runner.model_bytes()}
    llm.shutdown()
    return result


def measure(model: str, dtype: str = "float32") -> dict:
    """main() and tokenizer_main(), each in a fresh interpreter."""
    result = {}
    for args in ([model, dtype], [model, "--tokenizer"]):
        out = subprocess.run([sys.executable, "-m", "omniinfer.benchmarks.resident", *args],
                             capture_output=True, text=True, check=True)
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return result


if __name__ == "__main__":
    if sys.argv[2:3] == ["--tokenizer"]:
        print(json.dumps(tokenizer_main(sys.argv[1])))
    else:
        print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32")))
