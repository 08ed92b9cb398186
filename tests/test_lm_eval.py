"""lm-evaluation-harness's `local-completions` against `omniinfer serve` scores a local
multiple-choice task as lm-evaluation-harness's own transformers backend (`hf`) scores it on the
same model: the same accuracy, the same log-likelihood for every choice.

Slow tier; needs `pip install "omniinfer[eval]"` (lm-eval), skipped with that message without."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from test_serve_socket import CONSOLE_SCRIPT, free_port

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed: pip install 'omniinfer[eval]'")

pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).parent / "fixtures" / "lm_eval"
TASK = "omni_mc"
BATCH = 4  # several prompts per /v1/completions request


@pytest.fixture
def task_dir(tmp_path, monkeypatch):
    for name in ("omni_mc.yaml", "omni_mc.jsonl"):
        shutil.copy(TASK_DIR / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)  # the task's data_files is relative
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


@pytest.fixture
def model_path(checkpoint_dir):
    import omniinfer

    try:  # the trained demo model scores well above chance, which makes the comparison telling
        return omniinfer.demo_model_path()
    except FileNotFoundError:
        return checkpoint_dir("llama")


def evaluate(task_dir: Path, model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                   task_manager=TaskManager(include_path=str(task_dir)),
                                   batch_size=BATCH, log_samples=True, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0)


def serve(model_path: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    env["OMNIINFER_CPU_THREADS"] = "1"
    proc = subprocess.Popen([str(CONSOLE_SCRIPT), "serve", "--model", model_path, "--port",
                             str(port), "--served-model-name", "demo", "--num-kv-blocks", "256",
                             "--enable-prefix-caching"],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def per_choice(result: dict) -> list[list[float]]:
    return [[resp[0] for resp in sample["filtered_resps"]] for sample in
            sorted(result["samples"][TASK], key=lambda s: s["doc_id"])]


def test_local_completions_scores_what_transformers_scores(task_dir, model_path, tmp_path):
    reference = evaluate(task_dir, "hf", {"pretrained": model_path, "dtype": "float32",
                                          "device": "cpu"})
    proc, url = serve(model_path, tmp_path / "server.log")
    try:
        served = evaluate(task_dir, "local-completions", {
            "base_url": f"{url}/v1/completions", "model": "demo", "tokenizer": model_path,
            "tokenizer_backend": "huggingface", "tokenized_requests": True,
            "num_concurrent": 1, "max_retries": 1,
            # the hf backend tokenizes as the tokenizer says (the demo's adds a BOS); the API
            # backend adds none unless told: the same token ids on both sides
            "add_bos_token": True})
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    ref, got = reference["results"][TASK], served["results"][TASK]
    print(f"hf: acc {ref['acc,none']:.4f} acc_norm {ref['acc_norm,none']:.4f}; "
          f"omniinfer serve: acc {got['acc,none']:.4f} acc_norm {got['acc_norm,none']:.4f}")
    assert got["acc,none"] == ref["acc,none"] and got["acc_norm,none"] == ref["acc_norm,none"]
    ref_ll, got_ll = per_choice(reference), per_choice(served)
    assert len(got_ll) == len(ref_ll) == 20
    print("largest log-likelihood difference:", max(abs(a - b) for r, g in zip(ref_ll, got_ll)
                                                  for a, b in zip(r, g)))
    for ref_doc, got_doc in zip(ref_ll, got_ll):
        assert got_doc == pytest.approx(ref_doc, abs=1e-3)
    assert ref["acc,none"] > 0.25  # above chance: the task tells a model's choices apart
