"""A model split across several GGUF files (llama.cpp's gguf-split; the `gguf` package's writer
with `split_max_tensors` writes the same: NAME-00001-of-0000N.gguf .., the metadata in the
first) loads from any of its files and gives the whole file's tokens; a missing file, a renamed
one or one of another split is named. llama.cpp's own `llama-gguf-split` output is checked in
tests/test_gguf_llama_cpp.py."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("gguf")

from omniinfer import LLM, SamplingParams  # noqa: E402
from omniinfer.benchmarks.gguf_export import export  # noqa: E402
from omniinfer.quantization.gguf_file import GGUFFile  # noqa: E402
from omniinfer.quantization.gguf_header import GGUFError  # noqa: E402
from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = "hello world, this is"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same tiny random qwen2 model as one q4_k_m file and split into 3 (10 tensors a file)."""
    root = tmp_path_factory.mktemp("gguf_split")
    model = build_tiny_checkpoint(str(root / "model"), "qwen2", hidden_size=256, intermediate_size=512,
                                  vocab_size=1000, seed=5)
    whole = export(model, str(root / "whole.gguf"), "q4_k_m")
    os.mkdir(root / "split")
    first = export(model, str(root / "split" / "parts.gguf"), "q4_k_m", split_max_tensors=10)
    return whole, first


def _generate(path: str):
    llm = LLM(path, num_kv_blocks=16, max_model_len=128)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids, runner.model_bytes()
    finally:
        llm.shutdown()


def test_a_split_model_loads_from_any_of_its_files_as_the_whole_file(files):
    whole, first = files
    assert os.path.basename(first) == "parts-00001-of-00003.gguf"
    file = GGUFFile(first)
    assert len(file.shards) == 3 and all(len(s.tensors) <= 10 for s in file.shards)
    assert file.tensor_bytes() == GGUFFile(whole).tensor_bytes()
    tokens, held = _generate(whole)
    for part in (first, first.replace("00001-of", "00003-of")):
        assert _generate(part) == (tokens, held), part


def _copy_split(first: str, dst) -> list[str]:
    os.makedirs(dst)
    paths = []
    for i in range(1, 4):
        src = first.replace("00001-of", f"{i:05d}-of")
        paths.append(shutil.copy(src, dst / os.path.basename(src)))
    return paths


def test_a_missing_renamed_or_foreign_file_of_a_split_is_named(files, tmp_path):
    whole, first = files
    parts = _copy_split(first, tmp_path / "missing")
    os.remove(parts[2])
    with pytest.raises(GGUFError, match=r"parts-00001-of-00003.gguf is file 1 of a model split into 3; file 3, "
                                         r"\S+parts-00003-of-00003.gguf, is missing"):
        LLM(parts[0], num_kv_blocks=16)

    parts = _copy_split(first, tmp_path / "renamed")
    renamed = os.path.join(os.path.dirname(parts[1]), "middle.gguf")
    os.rename(parts[1], renamed)
    with pytest.raises(GGUFError, match=r"middle.gguf is file 2 of a model split into 3, but it is not named "
                                         r"NAME-00002-of-00003.gguf"):
        LLM(renamed, num_kv_blocks=16)

    # the first file of another split of the same model (2 files) in the place of this one's
    parts = _copy_split(first, tmp_path / "foreign")
    other = export(os.path.join(os.path.dirname(whole), "model"), str(tmp_path / "other.gguf"), "q4_k_m",
                   split_max_tensors=20)
    shutil.copy(other, parts[0])
    with pytest.raises(GGUFError, match=r"parts-00001-of-00003.gguf is file 1 of a model split into 2, but it is "
                                         r"not named NAME-00001-of-00002.gguf"):
        LLM(parts[0], num_kv_blocks=16)
    with pytest.raises(GGUFError, match=r"parts-00001-of-00003.gguf: split.no=0, split.count=2; as file 1 of 3 it "
                                         r"should say 0 and 3 \(a file of another split\?\)"):
        LLM(parts[1], num_kv_blocks=16)
