"""Incremental detokenization and stop-string handling.

Every detokenizer has the same contract:

* `add(token) -> str`: the token's text now (what a stop-string check needs);
* `push(token)`: the token, its text wanted only later (no stop strings to check);
* `take() -> str`: the text of the pushed tokens so far;
* `flush() -> str`: everything still held (pushed tokens, incomplete characters), once the
  sequence is done.
"""

from __future__ import annotations

import codecs
import itertools
from array import array

_CONTEXT_TOKENS = 6  # prompt tokens kept as left context (spacing of the first output token)


class _TextQueue:
    """`push`/`take` for detokenizers whose text comes token by token: decoded at once."""

    __slots__ = ()

    def push(self, token_id: int) -> None:
        self.queued += self.add(token_id)

    def take(self) -> str:
        text, self.queued = self.queued, ""
        return text


class IncrementalDetokenizer(_TextQueue):
    """Turns tokens into text as they arrive, holding back incomplete UTF-8 sequences.

    Decodes a small sliding window (from `prefix` to the end) and emits what it adds beyond
    the text of `prefix..read`, so the cost per token does not grow with the output.
    """

    __slots__ = ("tokenizer", "ids", "prefix", "read", "skip_special_tokens", "queued")

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.skip_special_tokens = skip_special_tokens
        self.queued = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text held back at the end (an incomplete character), once the sequence is done."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special_tokens)
        self.prefix = self.read = len(self.ids)
        return self.take() + after[len(before):]


class StreamDetokenizer(_TextQueue):
    """The same contract through the tokenizers library's DecodeStream (Rust, 0.8-1.6 us a token),
    for other fast tokenizers: it keeps its own window and holds back incomplete characters.

    DecodeStream raises where a later token changes text it already gave out: with a byte-fallback
    decoder (Llama 2's, Mistral's, Gemma's: `<0xNN>` tokens) a run of byte tokens that is not valid
    UTF-8 as a whole decodes to U+FFFD for every byte, so a byte that read as ")" alone reads as
    U+FFFD once an invalid byte follows it ("Invalid prefix encountered while decoding stream"). The
    sequence then goes on through IncrementalDetokenizer, its tokens since the last text given out
    first: the text already given out stays as it was."""

    __slots__ = ("backend", "stream", "context", "ids", "done", "skip_special_tokens", "queued",
                 "fallback")

    def __init__(self, backend, prompt_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.backend = backend  # a tokenizers.Tokenizer
        self.context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.stream = DecodeStream(ids=self.context, skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.done = 0  # ids[:done] are in the text given out; the rest wait (an incomplete character)
        self.skip_special_tokens = skip_special_tokens
        self.queued = ""
        self.fallback: IncrementalDetokenizer | None = None

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.fallback is not None:
            return self.fallback.add(token_id)
        try:
            text = self.stream.step(self.backend, token_id)
        except Exception:  # noqa: BLE001 - DecodeStream's "Invalid prefix" (above), a plain Exception
            return self._go_on_by_windows()
        if text:
            self.done = len(self.ids)
            return text
        return ""

    def _go_on_by_windows(self) -> str:
        """Hand the sequence to IncrementalDetokenizer, the text given out as its context: the
        text of the tokens still waiting."""
        self.fallback = IncrementalDetokenizer(self.backend, self.context + self.ids[:self.done],
                                               self.skip_special_tokens)
        return "".join(self.fallback.add(t) for t in self.ids[self.done:])

    def flush(self) -> str:
        """What still waits, through the window decoder too: decoded alone, the output's text
        would lose its first space to a SentencePiece decoder's Strip, and the end of it a
        character."""
        if self.fallback is None:
            if self.done == len(self.ids):
                return self.take()
            self.queued += self._go_on_by_windows()
        return self.take() + self.fallback.flush()


class ByteLevelDetokenizer:
    """For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2): every token is a fixed byte
    string, so the text is the output's bytes through an incremental UTF-8 decoder. That text
    is `tokenizer.decode(output ids)` exactly, however the tokens are grouped, so pushed tokens
    can wait until their text is read: a sequence that is neither streamed nor stopped by a
    string is decoded once, when it finishes."""

    __slots__ = ("table", "pending", "utf8")

    def __init__(self, table: ByteTable):
        self.table = table  # token id -> bytes (b"" for skipped specials and unknown ids)
        self.pending: list[int] = []
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        self.pending.append(token_id)
        return self.take()

    def push(self, token_id: int) -> None:
        self.pending.append(token_id)

    def take(self) -> str:
        pending = self.pending
        if not pending:
            return ""
        data = self.table.join(pending)
        pending.clear()
        return self.utf8.decode(data)

    def flush(self) -> str:
        text = self.take()
        return text + self.utf8.decode(b"", final=True)


class ByteTable:
    """Token id -> its bytes: one bytes object and where each token's end in it (a list of 152k
    bytes objects was 7.5 MB; this is the bytes and 0.6 MB)."""

    __slots__ = ("blob", "ends")

    def __init__(self, pieces: list[bytes]):
        self.blob = b"".join(pieces)
        self.ends = array("I", [0])
        self.ends.extend(itertools.accumulate(len(p) for p in pieces))

    def __len__(self) -> int:
        return len(self.ends) - 1

    def join(self, ids: list[int]) -> bytes:
        """The ids' bytes, one after another (ids outside the table: none)."""
        blob, ends, size = self.blob, self.ends, len(self.ends) - 1
        return b"".join([blob[ends[t]:ends[t + 1]] for t in ids if 0 <= t < size])


def byte_level_table(backend, skip_special_tokens: bool) -> ByteTable | None:
    """Each token id's bytes, as the tokenizers library's ByteLevel decoder turns tokens into
    bytes; None unless that decoder is the tokenizer's whole decoder."""
    from tokenizers import decoders, pre_tokenizers

    if type(backend.decoder) is not decoders.ByteLevel:
        return None
    char_byte = _byte_level_chars()
    if set(char_byte) != set(pre_tokenizers.ByteLevel.alphabet()):  # not the mapping known here
        return None
    added = backend.get_added_tokens_decoder()
    table = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(i)
        entry = added.get(i)
        if token is None or (skip_special_tokens and entry is not None and entry.special):
            table.append(b"")
            continue
        try:
            table.append(bytes([char_byte[c] for c in token]))
        except KeyError:  # a token with characters outside the alphabet stands for itself
            table.append(token.encode())
    return ByteTable(table)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-character mapping, inverted: printable bytes map to themselves, the rest
    to the characters from U+0100 on, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in kept}
    extra = 0
    for b in range(256):
        if b not in kept:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class Detokenizers:
    """Makes each sequence's detokenizer: the fastest one this tokenizer allows. The byte table
    is built once per `skip_special_tokens` value (~0.3 s for a 152k vocabulary): here for the
    default, so the first request does not wait for it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self.backend = backend if getattr(tokenizer, "is_fast", False) else None
        self.tables: dict[bool, ByteTable | None] = {}
        if self.backend is not None:
            self.table(True)

    def table(self, skip_special_tokens: bool) -> ByteTable | None:
        if skip_special_tokens not in self.tables:
            self.tables[skip_special_tokens] = byte_level_table(self.backend, skip_special_tokens)
        return self.tables[skip_special_tokens]

    def __call__(self, prompt_ids: list[int], skip_special_tokens: bool = True):
        if self.backend is not None:
            table = self.table(skip_special_tokens)
            if table is not None:
                return ByteLevelDetokenizer(table)
            try:
                return StreamDetokenizer(self.backend, prompt_ids, skip_special_tokens)
            except ImportError:  # tokenizers without DecodeStream
                pass
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens)


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string that ends in the last `new_len` chars."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
