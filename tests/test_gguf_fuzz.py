"""A stranger's GGUF file: a tiny model's file with its header mutated at random (metadata values
set to 0, 1, huge or NaN, tensor shapes, types and offsets rewritten, bytes flipped, the file
cut short), loaded and run. Each either serves or is a ValueError naming the file; nothing else
(a ZeroDivisionError, a torch error, a 549 GB allocation: each was found so and is fixed, see
tests/test_gguf_header.py). Seeded: the same cases every run."""

from __future__ import annotations

import random

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from omniinfer import LLM, SamplingParams  # noqa: E402
from omniinfer.benchmarks.gguf_export import export  # noqa: E402
from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

CASES = 200
INTS = [0, 1, 3, 7, 255, 1000, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63 - 1, 2**64 - 1]
FLOATS = [0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30, 1e-30]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_fuzz")
    model = build_tiny_checkpoint(str(root / "model"), "qwen2", hidden_size=128, intermediate_size=256,
                                  vocab_size=1000, seed=3)
    path = export(model, str(root / "file.gguf"), "q4_k_m")
    with open(path, "rb") as f:
        return f.read(), _targets(path)


def _targets(path: str) -> tuple[list, int]:
    """(name, offset, bytes, kind) of every metadata value and tensor-table entry; the header's end."""
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part):
        return part.ctypes.data - base

    out = []
    for field in reader.fields.values():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            part = field.parts[field.data[0]]
            out.append((field.name, at(part), part.nbytes, "f" if part.dtype.kind == "f" else "i"))
    for t in reader.tensors:
        parts = t.field.parts  # name length, name, dimension count, dimensions, type, offset
        out += [(f"{t.name}:dims", at(parts[3]), parts[3].nbytes, "i"), (f"{t.name}:type", at(parts[4]), 4, "i"),
                (f"{t.name}:offset", at(parts[5]), 8, "i"), (f"{t.name}:n_dims", at(parts[2]), 4, "i")]
    return out, min(t.data_offset for t in reader.tensors)


def _mutate(data: bytes, targets, header_end: int, rng: random.Random) -> tuple[bytes, list[str]]:
    data, done = bytearray(data), []
    for _ in range(rng.choice([1, 1, 2, 3])):
        roll = rng.random()
        if roll < 0.7:
            name, offset, n, kind = rng.choice(targets)
            if kind == "f":
                value = rng.choice(FLOATS)
                data[offset:offset + n] = np.array([value], np.float32 if n == 4 else np.float64).tobytes()
            else:
                value = rng.choice(INTS + [rng.randrange(2 ** min(8 * n, 64))])
                k = rng.randrange(max(1, n // 8)) * 8 if n > 8 else 0  # (one of a shape's dimensions)
                width = min(n, 8)
                data[offset + k:offset + k + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
            done.append(f"{name}={value}")
        elif roll < 0.9:
            offset, value = rng.randrange(header_end), rng.randrange(256)
            data[offset] = value
            done.append(f"byte {offset}={value}")
        else:
            cut = rng.randrange(len(data))
            data = data[:cut]
            done.append(f"cut at {cut}")
    return bytes(data), done


def test_a_mutated_file_serves_or_is_a_value_error_naming_it(source, tmp_path):
    whole, (targets, header_end) = source
    rng = random.Random(20261203)
    served, refused = 0, 0
    params = SamplingParams(max_tokens=3, temperature=0)
    for case in range(CASES):
        data, done = _mutate(whole, targets, header_end, rng)
        path = tmp_path / f"case{case}.gguf"
        path.write_bytes(data)
        try:
            llm = LLM(str(path), max_model_len=64, num_kv_blocks=8, max_num_seqs=2)
        except ValueError as e:
            assert str(path) in str(e), (done, str(e))
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001 - the finding, reported with the mutation that made it
            pytest.fail(f"{done}: {type(e).__name__}: {e}")
        try:
            llm.generate(["hello there"], params, use_tqdm=False)
            served += 1
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{done}: serving: {type(e).__name__}: {e}")
        finally:
            llm.shutdown()
        path.unlink()
    assert served and refused, (served, refused)  # (both kinds of case are reached)
    print(f"{served} served, {refused} refused")
