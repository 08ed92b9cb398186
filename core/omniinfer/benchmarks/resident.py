"""What a loaded model costs in resident memory, measured in a fresh process: `python -m
omniinfer.benchmarks.resident MODEL` prints JSON with the process's resident set before the model
(after importing the engine and selecting the platform) and after loading it
and serving one request, the KV cache's bytes and the weights the model holds. A fresh process,
because a benchmark that built a checkpoint first keeps that memory in its heap."""

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


def main(model: str, dtype: str) -> dict:
    import omniinfer.engine.llm_engine  # noqa: F401 - the engine's imports, before the baseline
    from omniinfer import LLM, SamplingParams
    from omniinfer.platforms.registry import select_platform

    select_platform()  # the plugins loaded (a platform's kernels load with the model: counted)
    before = resident_bytes()
    llm = LLM(model, dtype=dtype, max_num_seqs=1, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=MAX_MODEL_LEN // 16 + 1)  # one sequence's cache (zero-filled: resident)
    llm.generate({"prompt_token_ids": [1] * 128}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    after = resident_bytes()
    worker = llm.llm_engine.executor.worker
    result = {"baseline_rss_bytes": before, "rss_growth_bytes": after - before,
              "kv_cache_bytes": sum(t.numel() * t.element_size() for t in worker.cache_engine.device_cache),
              "model_bytes": worker.model_runner.model_bytes()}
    llm.shutdown()
    return result


def measure(model: str, dtype: str = "float32") -> dict:
    """main() in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-m", "omniinfer.benchmarks.resident", model, dtype],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32")))
