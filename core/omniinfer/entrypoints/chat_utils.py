"""Chat messages to a prompt, the one way `LLM.chat`, `omniinfer generate --chat` and the
server's /v1/chat/completions do it (as vLLM does): text content parts joined by newlines, an
assistant's tool-call arguments given to the template as objects, the template rendered to
text, and that text tokenized with no special tokens added (the template writes the BOS and
role markers it wants; adding them again would start the prompt with two BOS tokens)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping


def content_text(content, where: str) -> str:
    """A message's content as the template reads it: a string, None (""), or OpenAI's list of
    {"type": "text", "text": ...} parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError(f"{where} must be a string or a list of text parts, got "
                        f"{type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = repr(kind) if kind is not None else type(part).__name__
            raise ValueError(f"{where}[{i}] is a content part of type {shown}; only "
                             "{'type': 'text', 'text': ...} parts are supported (text models)")
        texts.append(part["text"])
    return "\n".join(texts)


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects: the Hermes, Qwen, Llama and Mistral
    templates write `arguments | tojson` and expect a mapping (vLLM does the same)."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
    return messages


def conversation(messages, where: str = "messages") -> list[dict]:
    """Checked copies of one conversation's messages (dicts with a string 'role' and a 'content';
    other keys such as 'name', 'tool_calls' and 'tool_call_id' go to the template as given). Any
    role the template knows is allowed (Llama 3.1's 'ipython', for one), as in vLLM."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{where} must be a non-empty list of messages (dicts with 'role' and "
                        f"'content'), got {_shown(messages)}")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, Mapping):
            raise TypeError(f"{at} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{at}['role']={role!r} is not allowed; give a role such as 'system', "
                             "'user', 'assistant' or 'tool'")
        message = dict(m, content=content_text(m.get("content"), f"{at}['content']"))
        if m.get("tool_calls"):
            message["tool_calls"] = [dict(c, function=dict(c.get("function") or {}))
                                     if isinstance(c, Mapping) else c for c in m["tool_calls"]]
        out.append(message)
    return template_messages(out)


def conversations(messages) -> list[list[dict]]:
    """`LLM.chat`'s `messages`: one conversation (a list of message dicts) or a list of them."""
    if not (isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple))):
        return [conversation(messages)]
    for i, c in enumerate(messages):
        if not isinstance(c, (list, tuple)):
            raise TypeError(f"messages[{i}] must be a conversation (a list of messages) as "
                            f"messages[0] is, got {type(c).__name__}")
    return [conversation(c, f"messages[{i}]") for i, c in enumerate(messages)]


def render(tokenizer, messages: list[dict], *, chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
    """The chat template (`chat_template`, else the tokenizer's) applied to checked messages.
    A tokenizer may hold several named templates (Hermes 2 Pro's, Command R's: "default",
    "tool_use", ...): transformers picks one, "tool_use" when tools are given. Raises ValueError
    when there is no template or it cannot render them."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                         "(continuing the last message adds no new turn)")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; pass chat_template (a Jinja "
                         "template string)")
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template:
        kwargs["chat_template"] = chat_template
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
        raise ValueError(f"the chat template could not render these messages: "
                         f"{type(e).__name__}: {e}") from None


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    """A rendered chat prompt's token ids: no special tokens added (the template wrote them)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
