"""`--reasoning-parser`: a thinking model's chain of thought apart from its answer, as vLLM
returns it. The text between `<think>` and `</think>` goes to the message's `reasoning` (and
`reasoning_content`, DeepSeek's older name that many clients read), the rest to `content`.

* `deepseek_r1`: the reply starts thinking (DeepSeek-R1's template writes `<think>` into the
  prompt; a leading `<think>` in the reply is dropped too) until `</think>`; a reply cut short
  before it is all reasoning. Also for Qwen3's Thinking-2507 models, whose template does the same.
* `qwen3`: the reply thinks only when it starts with `<think>` (Qwen3 with `enable_thinking`
  off, or a template that added an empty think block, answers without one).

The whitespace around the reasoning, and after `</think>`, is dropped (the templates write
newlines there); a reply without thinking is left as it is. A streamed reply gives the same two
texts as a whole one, whatever its chunks: `split` is the stream fed the whole text."""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_thinking: bool  # the reply is reasoning from its first character

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None for an empty part."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text, finished=True)
        return (reasoning or None), (content or None)


PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False))}

_UNDECIDED, _THINKING, _ANSWERING = range(3)


class ReasoningStream:
    """One choice's reply, text in as it is generated, (reasoning, content) pieces out. Holds
    back what may still turn out to be a tag, and whitespace that may end the reasoning."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = _UNDECIDED
        self.pending = ""  # text seen but not yet given out
        self.strip_start = False  # the current part has given out nothing, and drops leading whitespace

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.pending += delta
        reasoning = content = ""
        while True:
            if self.state == _UNDECIDED:
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending = head[len(START):]
                    self._enter(_THINKING)
                elif START.startswith(head) and not finished:
                    break  # (might still become the tag)
                elif self.parser.starts_thinking:
                    self._enter(_THINKING)
                else:
                    self.state = _ANSWERING  # (a reply without thinking is left as it is)
                continue
            if self.state == _THINKING:
                end = self.pending.find(END)
                if end >= 0:
                    reasoning += self._part(self.pending[:end].rstrip())
                    self.pending = self.pending[end + len(END):]
                    self._enter(_ANSWERING)
                    continue
                keep = 0 if finished else _held(self.pending, END)
                cut = len(self.pending) - keep
                reasoning += self._part(self.pending[:cut].rstrip() if finished else self.pending[:cut])
                self.pending = self.pending[cut:]
                if finished:
                    self.pending = ""
                break
            content += self._part(self.pending)
            self.pending = ""
            break
        return reasoning, content

    def _enter(self, state: int) -> None:
        self.state, self.strip_start = state, True

    def _part(self, text: str) -> str:
        if self.strip_start:
            text = text.lstrip()
            self.strip_start = not text
        return text


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` to hold back: trailing whitespace, and any
    ending that is a prefix of `tag`."""
    keep = len(text) - len(text.rstrip())
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            keep = max(keep, n + len(text[:-n]) - len(text[:-n].rstrip()))
            break
    return keep
