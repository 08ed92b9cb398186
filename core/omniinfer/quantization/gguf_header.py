"""The header of a GGUF file — its metadata and tensor table — read without materialising it.

`gguf.GGUFReader` builds numpy views for every element of every metadata array: for a
152k-token vocabulary and its merges that is ~300 MB of Python objects and ~6 s, of which
~100 MB stay in the heap after it is gone (measured on the medium Qwen2.5-shape file). Loading
reads the header three times (config, tensors, tokenizer), so this reader walks the header once
a read with `struct` over a memory map and keeps only scalars, strings and numeric arrays;
string arrays (the vocabulary, the merges) are kept as where they are, read on request.

The format (llama.cpp's gguf.md, the `gguf` package's constants): "GGUF", version (2 or 3),
tensor count, metadata count; each metadata entry a string key, a value type and a value; each
tensor a name, up to 4 dimensions (fastest first), a type and an offset into the data section,
which starts at the next multiple of `general.alignment` (32) after the table.
tests/test_gguf_header.py holds it to `gguf.GGUFReader` on the same files.

Every length and count is checked against the bytes left before anything is built from it, so
a truncated or corrupt header is a GGUFError naming the file, where and why — never a huge
allocation.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUFValueType
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFError(ValueError):
    """A GGUF file omniinfer cannot load: names the file, the tensor or key, and why."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as the file lists them: the fastest-moving first
    type_code: int  # GGMLQuantizationType
    offset: int  # from the start of the file (the data section's start included)


@dataclass(frozen=True, slots=True)
class StringArray:
    """A metadata array of strings, left in the file: `count` strings from byte `offset`."""

    count: int
    offset: int


class GGUFHeader:
    """`fields` (key -> int, float, bool, str, a numpy array of numbers, or a StringArray),
    `tensors` (in the file's order) and the memory map the tensors' bytes are read from."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.size = os.path.getsize(self.path)
        if self.size < 24:
            self._corrupt(0, f"{self.size} bytes, shorter than a GGUF header's 24")
        self.map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.map)
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (it starts with {bytes(self._buf[:4])!r}, not "
                            f"{MAGIC!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in VERSIONS:
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            why = "a big-endian file (not supported)" if swapped in VERSIONS else f"version {version}"
            raise GGUFError(f"{self.path} is GGUF {why}; supported: little-endian versions "
                            f"{', '.join(map(str, VERSIONS))}")
        # the smallest entries: a field of an empty key, a type and one byte; a tensor of an
        # empty name, one dimension, a type and an offset
        self._need(24, n_fields * 13 + n_tensors * 28, f"{n_fields} metadata entries and {n_tensors} tensors")
        pos = 24
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key, pos = self._string(pos, "a metadata key")
            self._need(pos, 4, f"the type of {key!r}")
            (value_type,) = struct.unpack_from("<I", self._buf, pos)
            if key in self.fields:
                self._corrupt(pos, f"metadata key {key!r} appears twice")
            self.fields[key], pos = self._value(pos + 4, value_type, key)
        self.tensors: list[TensorInfo] = []
        raw = []
        for _ in range(n_tensors):
            name, pos = self._string(pos, "a tensor name")
            self._need(pos, 4, f"tensor {name!r}'s dimension count")
            (n_dims,) = struct.unpack_from("<I", self._buf, pos)
            if not 1 <= n_dims <= MAX_DIMS:
                self._corrupt(pos, f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
            self._need(pos + 4, 8 * n_dims + 12, f"tensor {name!r}'s shape, type and offset")
            dims = struct.unpack_from(f"<{n_dims}Q", self._buf, pos + 4)
            if 0 in dims:
                self._corrupt(pos, f"tensor {name!r} has a dimension of 0 (shape {list(dims)})")
            type_code, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, tuple(int(d) for d in dims), int(type_code), int(offset)))
        names = [name for name, *_ in raw]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            self._corrupt(pos, f"tensor {twice[0]!r} appears twice")
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            self._corrupt(pos, f"general.alignment is {alignment!r}, not a power of two")
        self.data_offset = (pos + alignment - 1) // alignment * alignment
        for name, dims, type_code, offset in raw:
            if offset % alignment:
                self._corrupt(pos, f"tensor {name!r}'s data offset {offset} is not a multiple of the "
                                   f"alignment {alignment}")
            if self.data_offset + offset >= self.size:
                self._corrupt(pos, f"tensor {name!r}'s data would start at byte {self.data_offset + offset}, "
                                   "past the file's end")
            self.tensors.append(TensorInfo(name, dims, type_code, self.data_offset + offset))

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def strings(self, key: str) -> list[str]:
        """A string array's strings (the vocabulary: read only when asked)."""
        array = self.fields[key]
        if not isinstance(array, StringArray):
            raise GGUFError(f"{self.path}: metadata key {key!r} is not an array of strings")
        out, pos = [], array.offset
        for _ in range(array.count):
            text, pos = self._string(pos, f"an entry of {key!r}")
            out.append(text)
        return out

    def _need(self, pos: int, n: int, what: str) -> None:
        if n < 0 or pos + n > self.size:
            self._corrupt(pos, f"{what} need {n} bytes at offset {pos}, past the file's end")

    def _corrupt(self, pos: int, why: str):
        raise GGUFError(f"{self.path} is not a readable GGUF file: truncated or corrupt ({self.size} bytes; "
                        f"{why})")

    def _string(self, pos: int, what: str) -> tuple[str, int]:
        self._need(pos, 8, f"the length of {what}")
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        self._need(pos + 8, n, what)
        try:
            return str(self._buf[pos + 8:pos + 8 + n], "utf-8"), pos + 8 + n
        except UnicodeDecodeError as e:
            self._corrupt(pos, f"{what} at offset {pos} is not UTF-8 ({e.reason})")

    def _value(self, pos: int, value_type: int, key: str):
        if value_type in _SCALAR:
            fmt = "<" + _SCALAR[value_type]
            self._need(pos, struct.calcsize(fmt), f"the value of {key!r}")
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if value_type == STRING:
            return self._string(pos, f"the value of {key!r}")
        if value_type != ARRAY:
            self._corrupt(pos, f"metadata key {key!r} has value type {value_type} (0 to 12 exist)")
        self._need(pos, 12, f"the array header of {key!r}")
        element, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        if element in _SCALAR:
            width = struct.calcsize(_SCALAR[element])
            self._need(pos, count * width, f"the {count} values of {key!r}")
            values = np.frombuffer(self._buf, dtype=np.dtype(_NUMPY[element]).newbyteorder("<"), count=count,
                                   offset=pos)
            return values.copy(), pos + count * width  # (a copy: the map may close)
        if element != STRING:
            self._corrupt(pos, f"metadata key {key!r} is an array of type {element} (numbers or strings "
                               "are read)")
        self._need(pos, count * 8, f"the {count} strings of {key!r}")
        start = pos
        for _ in range(count):  # variable length: walked, not kept
            self._need(pos, 8, f"an entry of {key!r}")
            (n,) = struct.unpack_from("<Q", self._buf, pos)
            pos += 8 + n
        self._need(start, pos - start, f"the {count} strings of {key!r}")
        return StringArray(count, start), pos


SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")  # gguf-split's names


def open_shards(path: str) -> list[GGUFHeader]:
    """The headers of a model's files, the one holding the metadata first: [the file's] for a
    whole model; for a split one all of its files, found by name from any of them. llama.cpp's
    `gguf-split` and the `gguf` package's writer split a model into NAME-00001-of-0000N.gguf ..
    NAME-0000N-of-0000N.gguf, the metadata in the first, each file's tensors its own, every file
    saying `split.no` (0-based) and `split.count`, the first `split.tensors.count` too. A file
    missing, or one of another split, is a GGUFError naming it."""
    first = GGUFHeader(path)
    count, no = first.get("split.count", 1), first.get("split.no", 0)
    if count == 1 and no == 0:
        return [first]
    if not (isinstance(count, int) and isinstance(no, int) and 0 <= no < count):
        raise GGUFError(f"{first.path}: split.no={no!r} and split.count={count!r} do not describe a part of a split model")
    match = SPLIT_NAME.match(os.path.basename(first.path))
    if match is None or int(match["count"]) != count or int(match["no"]) != no + 1:
        raise GGUFError(f"{first.path} is file {no + 1} of a model split into {count}, but it is not named "
                        f"NAME-{no + 1:05d}-of-{count:05d}.gguf, so the others cannot be found (restore the "
                        "names gguf-split gave them, or merge them: llama-gguf-split --merge)")
    stem = os.path.join(os.path.dirname(first.path), match["stem"])
    shards = []
    for i in range(count):
        part = f"{stem}-{i + 1:05d}-of-{count:05d}.gguf"
        if i == no:
            shards.append(first)
            continue
        if not os.path.isfile(part):
            raise GGUFError(f"{first.path} is file {no + 1} of a model split into {count}; file {i + 1}, "
                            f"{part}, is missing")
        shard = GGUFHeader(part)
        if (shard.get("split.no"), shard.get("split.count")) != (i, count):
            raise GGUFError(f"{part}: split.no={shard.get('split.no')!r}, split.count={shard.get('split.count')!r}; "
                            f"as file {i + 1} of {count} it should say {i} and {count} (a file of another split?)")
        shards.append(shard)
    total, held = shards[0].get("split.tensors.count"), sum(len(s.tensors) for s in shards)
    if total is not None and total != held:
        raise GGUFError(f"{shards[0].path}: split.tensors.count={total!r}, but the {count} files hold {held} tensors")
    return shards
