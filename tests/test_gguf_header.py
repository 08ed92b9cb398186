"""The lean GGUF header reader (quantization/gguf_header.py) against the `gguf` package's own
reader on the same files; a damaged header is a clear error, never a huge allocation; the
tokenizer built from a GGUF file is the one transformers' AutoTokenizer builds, chat template
included, with BOS and the special tokens as the file says; loading holds no file bytes twice."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import weakref

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from omniinfer.benchmarks.gguf_export import export  # noqa: E402
from omniinfer.quantization import gguf_file, gguf_tokenizer  # noqa: E402
from omniinfer.quantization.gguf_header import GGUFError, GGUFHeader, StringArray  # noqa: E402
from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two GGUF files (llama Q4_K_M with a chat template, qwen2 Q8_0) of tiny random models."""
    root = tmp_path_factory.mktemp("gguf_header")
    out = {}
    for arch, file_type in (("llama", "q4_k_m"), ("qwen2", "q8_0")):
        model = build_tiny_checkpoint(str(root / arch), arch, hidden_size=256, intermediate_size=512,
                                      vocab_size=1000, seed=5)
        if arch == "llama":
            config = os.path.join(model, "tokenizer_config.json")
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
            data["chat_template"] = TEMPLATE
            with open(config, "w", encoding="utf-8") as f:
                json.dump(data, f)
        out[arch] = export(model, str(root / f"{arch}-{file_type}.gguf"), file_type)
    return out


def _reader_value(field):
    """What the gguf package reads for a field, as plain Python values."""
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_header_reads_as_the_gguf_package_reads_it(files, arch):
    path = files[arch]
    reader = gguf.GGUFReader(path, "r")
    header = GGUFHeader(path)
    want = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # (the reader's own)
    assert set(header.fields) == set(want)
    for key, field in want.items():
        ours = header.fields[key]
        if isinstance(ours, StringArray):
            ours = header.strings(key)
        elif isinstance(ours, np.ndarray):
            ours = ours.tolist()
        theirs = _reader_value(field)
        if isinstance(theirs, float):
            assert ours == pytest.approx(theirs, rel=1e-7), key
        else:
            assert ours == theirs, key
    assert len(header.tensors) == len(reader.tensors)
    for ours, theirs in zip(header.tensors, reader.tensors):
        assert ours.name == theirs.name
        assert ours.type_code == int(theirs.tensor_type)
        assert ours.dims == tuple(int(d) for d in theirs.shape)
        assert ours.offset == int(theirs.data_offset)
    tensors = gguf_file.GGUFFile(path).tensor_bytes()
    assert tensors == {t.name: int(t.n_bytes) for t in reader.tensors}
    assert len(header.strings("tokenizer.ggml.tokens")) == len(reader.fields["tokenizer.ggml.tokens"].data)


def _corrupt(path: str, out, edit) -> str:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    edit(data)
    out.write_bytes(bytes(data))
    return str(out)


def _offset_of(data: bytes, key: str) -> int:
    """Where metadata `key`'s value type sits (just past its name)."""
    at = data.index(key.encode())
    return at + len(key)


def test_a_damaged_header_is_a_clear_error_before_any_large_allocation(files, tmp_path):
    path = files["qwen2"]
    size = os.path.getsize(path)
    header_end = GGUFHeader(path).data_offset
    with open(path, "rb") as f:
        whole = f.read()
    for cut in (0, 3, 20, 24, 40, 200, header_end // 3, header_end // 2, header_end - 1):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(GGUFError, match=rf"cut{cut}.gguf (is not a readable GGUF file: truncated or corrupt"
                                             rf"|is not a GGUF file)"):
            GGUFHeader(str(short))
    assert size > header_end

    def huge_string(data):  # the first key's length: 2^60 bytes
        data[24:32] = struct.pack("<Q", 1 << 60)

    with pytest.raises(GGUFError, match=r"a metadata key need 1152921504606846976 bytes at offset 32, past the "
                                         r"file's end"):
        GGUFHeader(_corrupt(path, tmp_path / "string.gguf", huge_string))

    def huge_array(data):  # the vocabulary's count: 2^50 strings
        at = _offset_of(data, "tokenizer.ggml.tokens")
        data[at + 8:at + 16] = struct.pack("<Q", 1 << 50)

    with pytest.raises(GGUFError, match=r"the 1125899906842624 strings of 'tokenizer.ggml.tokens' need"):
        GGUFHeader(_corrupt(path, tmp_path / "array.gguf", huge_array))

    def counts(data):
        data[8:16] = struct.pack("<Q", 1 << 40)

    with pytest.raises(GGUFError, match=r"1099511627776 tensors need"):
        GGUFHeader(_corrupt(path, tmp_path / "count.gguf", counts))

    def bad_utf8(data):
        at = data.index(b"general.architecture")
        data[at] = 0xFF

    with pytest.raises(GGUFError, match=r"a metadata key at offset \d+ is not UTF-8"):
        GGUFHeader(_corrupt(path, tmp_path / "utf8.gguf", bad_utf8))

    def big_endian(data):
        data[4:8] = struct.pack(">I", 3)

    with pytest.raises(GGUFError, match=r"is GGUF a big-endian file \(not supported\); supported: little-endian"):
        GGUFHeader(_corrupt(path, tmp_path / "be.gguf", big_endian))

    def value_type(data):
        at = _offset_of(data, "general.architecture")
        data[at:at + 4] = struct.pack("<I", 77)

    with pytest.raises(GGUFError, match=r"metadata key 'general.architecture' has value type 77 \(0 to 12 exist\)"):
        GGUFHeader(_corrupt(path, tmp_path / "type.gguf", value_type))
    def duplicate_key(data):  # general.file_type renamed to the other 17-letter key, both uint32
        at = data.index(b"general.file_type")
        data[at:at + 17] = b"qwen2.block_count"

    with pytest.raises(GGUFError, match=r"metadata key 'qwen2.block_count' appears twice"):
        GGUFHeader(_corrupt(path, tmp_path / "twice.gguf", duplicate_key))

    def duplicate_tensor(data):
        at = data.index(b"blk.0.ffn_up.weight")
        data[at:at + 19] = b"blk.1.ffn_up.weight"

    with pytest.raises(GGUFError, match=r"tensor 'blk.1.ffn_up.weight' appears twice"):
        GGUFHeader(_corrupt(path, tmp_path / "tensor_twice.gguf", duplicate_tensor))

    def empty_tensor(data):  # (found by mutating files at random: a dimension of 0 met a torch view error)
        at = data.index(b"blk.0.attn_norm.weight") + len("blk.0.attn_norm.weight")
        assert struct.unpack("<I", data[at:at + 4]) == (1,)
        data[at + 4:at + 12] = struct.pack("<Q", 0)

    with pytest.raises(GGUFError, match=r"tensor 'blk.0.attn_norm.weight' has a dimension of 0 \(shape \[0\]\)"):
        GGUFHeader(_corrupt(path, tmp_path / "empty.gguf", empty_tensor))
    def no_heads(data):  # a count of 0 (hidden / heads would divide by it)
        at = _offset_of(data, "qwen2.attention.head_count")
        assert struct.unpack("<I", data[at:at + 4]) == (4,)  # (uint32)
        data[at + 4:at + 8] = struct.pack("<I", 0)

    with pytest.raises(GGUFError, match=r"metadata key 'qwen2.attention.head_count' is 0; expected a positive count"):
        gguf_file.GGUFFile(_corrupt(path, tmp_path / "heads.gguf", no_heads)).hf_config()
    with pytest.raises(GGUFError, match=r"is not a GGUF file \(it starts with b'\\x89PNG'"):
        GGUFHeader(_corrupt(path, tmp_path / "png.gguf", lambda d: d.__setitem__(slice(0, 4), b"\x89PNG")))


def test_the_tokenizer_is_the_one_autotokenizer_builds(files):
    from transformers import AutoTokenizer

    texts = ["Hello world", "  two  spaces\tand a tab", "caf\u00e9 \u65e5\u672c \U0001f600", "", "a" * 300]
    for arch, path in files.items():
        ours = gguf_tokenizer.load_tokenizer(path)
        theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        assert type(ours) is type(theirs), arch
        assert len(ours) == len(theirs)
        assert ours.all_special_tokens == theirs.all_special_tokens
        assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
        for text in texts + [f"{ours.eos_token}x{ours.eos_token}" if ours.eos_token else "x"]:
            ids = ours(text).input_ids
            assert ids == theirs(text).input_ids, (arch, text)
            assert ours.decode(ids) == theirs.decode(ids)
        assert ours.chat_template == theirs.chat_template
    assert gguf_tokenizer.load_tokenizer(files["llama"]).chat_template == TEMPLATE


def tokenizer_file(root, arch: str, add_bos: bool | None, pre: str | None = None, monkeypatch=None,
                   beside: bool = False) -> str:
    """A q8_0 file of a tiny `arch` model, alone in its directory (as downloaded; `beside`: in its
    checkpoint's, beside a tokenizer_config.json), whose tokenizer_config says `add_bos_token`
    (None: nothing) and whose pre-tokenizer is `pre` (None: the exporter's)."""
    model = build_tiny_checkpoint(str(root / "ckpt"), arch, vocab_size=1000, seed=1)
    if add_bos is not None:
        config = os.path.join(model, "tokenizer_config.json")
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
        with open(config, "w", encoding="utf-8") as f:
            json.dump({**data, "add_bos_token": add_bos}, f)
    if pre is not None:
        monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre", lambda self, _, w=gguf.GGUFWriter.add_tokenizer_pre:
                            w(self, pre))
    if beside:
        return export(model, os.path.join(model, "q8_0.gguf"), "q8_0")
    os.makedirs(root / "file")
    return export(model, str(root / "file" / "q8_0.gguf"), "q8_0")


@pytest.mark.parametrize("arch, add_bos, pre, bos, beside", [
    ("llama", True, None, True, False), ("llama", False, None, False, False), ("llama", None, None, False, False),
    ("llama", None, "llama-bpe", True, False),  # (Llama 3's pre-tokenizer: llama.cpp adds BOS unless told not to)
    ("llama", False, "llama-bpe", False, False), ("qwen2", True, None, True, False), ("qwen2", None, None, False, False),
    ("phi3", True, None, True, False), ("phi3", None, None, False, False), ("gemma2", True, None, True, False),
    # beside a tokenizer_config.json, transformers' class for llama and phi3 files lost every special token
    ("llama", True, None, True, True), ("phi3", None, None, False, True),
])
def test_bos_and_the_special_tokens_follow_the_file(tmp_path, monkeypatch, arch, add_bos, pre, bos, beside):
    """A prompt starts with BOS as llama.cpp starts it (tests/test_gguf_llama_cpp.py holds the ids
    to `llama-tokenize`'s): the file's add_bos_token, else llama.cpp's default for its vocabulary;
    the file's BOS / EOS / padding tokens are the tokenizer's, so a chat template's `bos_token`
    renders. (transformers' class for llama and phi3 files did not always: beside a
    tokenizer_config.json it had no special tokens at all, so a chat template's bos_token rendered
    as nothing; and a Llama 3 file that relies on llama.cpp's default had no BOS.)"""
    from omniinfer import LLM, SamplingParams

    path = tokenizer_file(tmp_path, arch, add_bos, pre, monkeypatch, beside)
    tokenizer = gguf_tokenizer.load_tokenizer(path)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    plain = tokenizer("Hello world", add_special_tokens=False).input_ids
    assert tokenizer("Hello world").input_ids == [0] * bos + plain
    assert tokenizer("Hello world", "again").input_ids[:bos + len(plain)] == [0] * bos + plain
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>hi</s>"
    llm = LLM(path, num_kv_blocks=16, max_model_len=64)
    try:
        out = llm.generate("Hello world", SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt_token_ids == [0] * bos + plain
    finally:
        llm.shutdown()


def test_the_chat_template_of_a_gguf_file_serves_chat(files):
    from omniinfer import LLM

    llm = LLM(files["llama"], num_kv_blocks=32)
    try:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert prompt == "<|user|>hi\n<|assistant|>"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_loading_holds_no_file_bytes_twice(files, monkeypatch, activations):
    """Every tensor read from the file is either held by a layer or gone once loaded: a fused
    layer's parts (q, k, v; gate, up) joined into one piece, and pieces a kernel repacked, do not
    stay alive beside what replaced them."""
    from omniinfer import LLM

    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", activations)
    read = []
    original = gguf_file.GGUFTensor._bytes

    def recording(self, rows):
        t = original(self, rows)
        read.append(weakref.ref(t))
        return t

    monkeypatch.setattr(gguf_file.GGUFTensor, "_bytes", recording)
    path = files["qwen2"]
    shutil.copy(path, path + ".copy.gguf")  # (a file of its own: no other test's model shares it)
    llm = LLM(path + ".copy.gguf", num_kv_blocks=32)
    try:
        gc.collect()
        model = llm.llm_engine.executor.worker.model_runner.model
        held = {t.untyped_storage().data_ptr() for m in model.modules() if getattr(m, "qweight", None) is not None
                for s in m.qweight.segments for t in s.piece.tensors.values()}
        held |= {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
        alive = [r() for r in read if r() is not None]
        assert read and all(t.untyped_storage().data_ptr() in held for t in alive), \
            f"{sum(t.untyped_storage().data_ptr() not in held for t in alive)} of {len(read)} tensors read stay alive"
    finally:
        llm.shutdown()
        os.unlink(path + ".copy.gguf")


def _set_u32(key: str, value: int):
    def edit(data):
        at = _offset_of(data, key)
        assert struct.unpack("<I", data[at:at + 4]) == (4,)  # (a uint32)
        data[at + 4:at + 8] = struct.pack("<I", value)
    return edit


@pytest.mark.parametrize("key, value, message", [
    ("qwen2.embedding_length", 1, r"hidden_size=1 in \S+ is not a multiple of num_attention_heads=4"),
    ("qwen2.attention.head_count_kv", 3, r"num_key_value_heads=3 in \S+ is not allowed; it must divide "
                                         r"num_attention_heads=4"),
    ("qwen2.embedding_length", 4 * 33, r"the head size 33 \(\S+\) is not allowed; rotary embeddings need an even"),
    ("qwen2.block_count", 65535, r"metadata key 'qwen2.block_count' is 65535, but the file's tensors are of "
                                 r"blocks 0-1$"),  # (it built 65535 layers before finding tensors missing)
])
def test_metadata_whose_sizes_do_not_fit_together_is_named(files, tmp_path, key, value, message):
    """(Found by mutating a file's metadata at random: an embedding length of 1 was a
    ZeroDivisionError deep in the model's construction, a block count of 65535 minutes of
    building layers.)"""
    from omniinfer import LLM

    path = _corrupt(files["qwen2"], tmp_path / "sizes.gguf", _set_u32(key, value))
    with pytest.raises(ValueError, match=message):
        LLM(path, num_kv_blocks=8, max_model_len=64)


def test_the_rope_table_holds_max_model_len_positions_not_the_files_context(files, tmp_path):
    """A file that allows 2^32 - 1 positions, served at max_model_len=64: the cos/sin table has
    64 rows (it had the file's 4 billion: a 549 GB allocation, found by mutating the file's
    metadata; a real 1M-context model's was 0.5 GiB whatever max_model_len said)."""
    from omniinfer import LLM, SamplingParams

    path = _corrupt(files["qwen2"], tmp_path / "context.gguf", _set_u32("qwen2.context_length", 2 ** 32 - 1))
    llm = LLM(path, num_kv_blocks=8, max_model_len=64)
    try:
        model = llm.llm_engine.executor.worker.model_runner.model
        assert {m.cos.shape[0] for m in model.modules() if hasattr(m, "cos")} == {64}
        out = llm.generate({"prompt_token_ids": list(range(1, 40))},
                           SamplingParams(max_tokens=64 - 39, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 64 - 39  # (to the last position the table holds)
    finally:
        llm.shutdown()


# ---- a SentencePiece vocabulary (Llama 2's, Mistral's kind) ------------------------------------
SPM_TEXTS = ["Hello world", " leading space", "two  spaces", "naïve café 😀 日本語", "\nnewline first",
             "tabs\tand\nlines", "def main(argv):\n    return 0", "x" * 30, ""]
SPECIAL_TEXTS = ["hi </s> there", "</s> x", "a</s>b"]


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    """A q8_0 file of a tiny llama whose tokenizer is Llama 2's kind (build_sentencepiece_tokenizer),
    alone in its directory, and its checkpoint."""
    root = tmp_path_factory.mktemp("spm")
    model = build_tiny_checkpoint(str(root / "ckpt"), "llama", tokenizer="sentencepiece", hidden_size=128,
                                  intermediate_size=256, seed=3)
    os.makedirs(root / "file")
    return export(model, str(root / "file" / "q8_0.gguf"), "q8_0"), model


def test_a_sentencepiece_vocabulary_tokenizes_as_its_checkpoint(spm_file):
    """The exporter writes it as llama.cpp's converter does (tokenizer model "llama", `<0xNN>`
    tokens of type BYTE, <unk> UNKNOWN); the tokenizer built from the file encodes every text as
    the checkpoint's own tokenizer does, BOS first, with a space before the text and after each
    special token (llama.cpp's add_space_prefix; transformers' class for the file put it only at
    the start, and not before a leading space), and decodes back to the text."""
    from transformers import AutoTokenizer

    path, model = spm_file
    reader = gguf.GGUFReader(path)
    assert bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    types = reader.fields["tokenizer.ggml.token_type"]
    types = [int(types.parts[i][0]) for i in types.data]
    assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and set(types[259:]) == {1}
    ours, ref = gguf_tokenizer.load_tokenizer(path), AutoTokenizer.from_pretrained(model)
    for text in SPM_TEXTS + SPECIAL_TEXTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ids[0] == 1
    for text in SPM_TEXTS:
        assert ours.decode(ours(text).input_ids, skip_special_tokens=True) == text
    assert ours.convert_ids_to_tokens(ours(" hi").input_ids)[:3] == ["<s>", "\u2581", "\u2581"]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_sentencepiece_file_without_the_space_prefix(tmp_path, monkeypatch, arch):
    """tokenizer.ggml.add_space_prefix false (as llama.cpp's converter writes Gemma's files; the
    exporter does too): no space is put before the text."""
    from transformers import AutoTokenizer

    if arch == "llama":
        monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_pre",
                            lambda self, pre, w=gguf.GGUFWriter.add_tokenizer_pre: (w(self, pre),
                                                                                   self.add_add_space_prefix(False)))
    model = build_tiny_checkpoint(str(tmp_path / "ckpt"), arch, tokenizer="sentencepiece", seed=3)
    os.makedirs(tmp_path / "file")
    path = export(model, str(tmp_path / "file" / "q8_0.gguf"), "q8_0")
    ours, ref = gguf_tokenizer.load_tokenizer(path), AutoTokenizer.from_pretrained(model)
    pieces = ref.backend_tokenizer.model.tokenize("hello\u2581world")  # (the pieces, no space before)
    assert ours("hello world").input_ids == [1] + [p.id for p in pieces]


def test_a_sentencepiece_file_runs_as_transformers_runs_it(spm_file, monkeypatch):
    """The engine on the file (float activations: exact up to float32 sums): the prompt's ids are
    the checkpoint tokenizer's and the greedy tokens transformers' on the same file. A random
    model writes stray byte tokens, so the text is checked against the tokenizer's decode of
    prompt and output whole where it can be: every character that decode gives (not U+FFFD)
    appears in the engine's text, in order. Decoded whole, a run of byte tokens that is invalid
    UTF-8 is U+FFFD for every byte, even those that read as a character alone, which the engine
    gave out as that character when it came."""
    from omniinfer import LLM, SamplingParams
    from omniinfer.engine.detokenizer import Detokenizers
    from omniinfer.testing.greedy import hf_greedy

    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    path, model = spm_file
    ours = gguf_tokenizer.load_tokenizer(path)
    prompts = ["The quick brown fox", " leading space and \U0001f600"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, num_kv_blocks=32, max_model_len=64)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == ours(prompt).input_ids
        [(tokens, _)] = hf_greedy(os.path.dirname(path), [out.prompt_token_ids], 12, os.path.basename(path))
        assert out.outputs[0].token_ids == tokens
        text = out.outputs[0].text
        d = Detokenizers(ours)(out.prompt_token_ids, True)
        assert "".join(d.add(t) for t in tokens) + d.flush() == text
        whole = ours.decode(out.prompt_token_ids + tokens, skip_special_tokens=True)
        assert whole.startswith(prompt)
        left = iter(text)
        assert all(c in left for c in whole[len(prompt):] if c != "\ufffd"), (text, whole)
