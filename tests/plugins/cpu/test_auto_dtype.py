"""dtype="auto" on the CPU: a float16 checkpoint runs in bfloat16 (x86 has no float16
arithmetic: its products took 3.7x bfloat16's time on the medium shape), as vLLM's CPU backend
does; an explicit dtype is kept, and other checkpoints' dtypes are left alone."""

from __future__ import annotations

import logging

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.platforms.interface import Platform
from omniinfer.testing.tiny_models import build_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("fp16") / "m"), "llama", dtype="float16")


def run(llm) -> list[int]:
    return llm.generate({"prompt_token_ids": [5, 17, 33, 9]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_float16_checkpoint_runs_in_bfloat16_unless_asked(fp16_checkpoint, checkpoint_dir, caplog):
    with caplog.at_level(logging.INFO, logger="omniinfer.engine.llm_engine"):
        auto = LLM(fp16_checkpoint, num_kv_blocks=16, block_size=8)
    assert auto.llm_engine.config.model.dtype == torch.bfloat16
    assert "the checkpoint is float16; platform cpu runs it in bfloat16 (dtype='auto'; pass " \
           "dtype='float16' to keep it)" in caplog.text
    assert run(auto) == run(LLM(fp16_checkpoint, dtype="bfloat16", num_kv_blocks=16, block_size=8))
    kept = LLM(fp16_checkpoint, dtype="float16", num_kv_blocks=16, block_size=8)
    assert kept.llm_engine.config.model.dtype == torch.float16
    for name, dtype in (("llama", torch.float32), ("llama_bf16", torch.bfloat16)):
        assert LLM(checkpoint_dir(name), num_kv_blocks=16, block_size=8).llm_engine.config.model.dtype == dtype


def test_the_draft_model_follows(fp16_checkpoint):
    llm = LLM(fp16_checkpoint, num_kv_blocks=32, block_size=8, speculative_model=fp16_checkpoint,
              num_speculative_tokens=2)
    assert llm.llm_engine.config.speculative.draft.dtype == torch.bfloat16
    assert next(llm.llm_engine.executor.worker.proposer.runner.model.parameters()).dtype == torch.bfloat16
    assert len(run(llm)) == 8


def test_platforms_keep_the_checkpoints_dtype_by_default():
    assert all(Platform.auto_dtype(d) == d for d in (torch.float16, torch.bfloat16, torch.float32))
