"""POST /v1/chat/completions: messages through the chat template, answered whole or as SSE."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import aclosing

from omniinfer.entrypoints.chat_utils import template_messages
from omniinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    now,
    random_id,
    usage,
)
from omniinfer.entrypoints.openai.reasoning import ReasoningStream
from omniinfer.entrypoints.openai.serving_common import (
    SMALL_TEXT_CHARS,
    ServingContext,
    StreamProgress,
    chat_logprobs,
    engine_error,
    merge,
    output_error,
    prompt_logprobs_json,
    sse,
)
from omniinfer.entrypoints.openai.structured import constrain
from omniinfer.entrypoints.openai.tools.serving import (
    ToolPlan,
    ToolStream,
    finish_reason,
)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 ) -> dict | AsyncIterator[str]:
    """The response body, or (stream=true) an iterator of SSE events ending with [DONE]."""
    ctx.check_request(req)
    plan = ToolPlan.of(req, ctx.tools)
    params = req.sampling_params(max_tokens=req.token_limit, logprobs=req.num_logprobs,
                                 defaults=ctx.generation_defaults)
    constrain(ctx, req, params, req.tool_constraint(plan.choice), plan.choice)
    kwargs = req.chat_template_kwargs
    if req.tools:
        kwargs = {**(kwargs or {}), "tools": req.template_tools()}
    text = await render_messages(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, kwargs=kwargs)
    # the template writes the special tokens it wants (a BOS, role markers): add none
    prompt_input = ctx.truncated(await ctx.prompt_input(text, add_special_tokens=False, param="messages"),
                                 params)
    ctx.check_length(prompt_input, params, prompt_param="messages")
    request_id = random_id("chatcmpl")
    stream = ctx.generate(request_id, prompt_input, params)
    num_prompt = len(prompt_input["prompt_token_ids"])
    if req.stream:
        return _stream(ctx, req, request_id, num_prompt, stream, plan)
    return await _full(ctx, req, request_id, num_prompt, stream, plan)


async def render_messages(ctx: ServingContext, messages, **kwargs) -> str:
    """The chat template applied to `messages` (off the event loop when they are long)."""
    inputs = template_messages([m.as_template_input() for m in messages])
    size = sum(len(m["content"]) for m in inputs)
    if size <= SMALL_TEXT_CHARS:
        return ctx.render_chat(inputs, **kwargs)
    return await ctx.off_loop(functools.partial(ctx.render_chat, inputs, **kwargs))


async def _full(ctx, req, request_id, num_prompt, stream, plan) -> dict:
    final = None
    try:
        async with aclosing(merge([stream])) as merged:
            async for _, out in merged:
                final = out
    except Exception as e:  # noqa: BLE001 - answered as an OpenAI error
        raise engine_error(e) from None
    if (error := output_error(final)) is not None:
        raise error
    choices = []
    for c in final.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [],
                                     req.top_logprobs or 0)
        message, has_calls = _message(ctx, plan, c.text)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish_reason(c.finish_reason, has_calls),
                        "stop_reason": c.stop_reason})
    num_completion = sum(len(c.token_ids) for c in final.outputs)
    return {"id": request_id, "object": "chat.completion", "created": now(),
            "model": ctx.model_name, "choices": choices,
            "usage": usage(num_prompt, num_completion),
            "prompt_logprobs": prompt_logprobs_json(ctx.tokenizer, final.prompt_logprobs)}


def _message(ctx, plan, text: str) -> tuple[dict, bool]:
    """The assistant message of a whole reply: its reasoning apart (--reasoning-parser), then
    its tool calls apart from the content."""
    if ctx.reasoning_parser is None:
        return plan.message(text)
    reasoning, content = ctx.reasoning_parser.split(text)
    message, has_calls = plan.message(content or "")
    if content is None and not has_calls:
        message["content"] = None
    if reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning  # (vLLM's name, DeepSeek's)
    return message, has_calls


async def _stream(ctx, req, request_id, num_prompt, stream, plan) -> AsyncIterator[str]:
    progress = StreamProgress(request_id, "chat.completion.chunk", ctx.model_name, num_prompt,
                              req.include_usage, now())
    chunk = progress.chunk
    tool_streams = [ToolStream(plan) for _ in range(req.n)]
    thinking = ([ReasoningStream(ctx.reasoning_parser) for _ in range(req.n)]
                if ctx.reasoning_parser is not None else None)

    try:
        for index in range(req.n):  # the role first, as OpenAI does
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}], req.continuous_usage)
        async with aclosing(merge([stream])) as merged:
            async for _, out in merged:
                if (error := output_error(out)) is not None:
                    raise error
                for c in out.outputs:
                    news = progress.news(c.index, c, bool(req.logprobs))
                    if news is None:
                        continue
                    text, new_ids, _, start_tokens = news
                    logprobs = None
                    if req.logprobs:
                        steps = (c.logprobs or [])[start_tokens:start_tokens + len(new_ids)]
                        logprobs = chat_logprobs(ctx.tokenizer, new_ids, steps, req.top_logprobs or 0)
                    progress.sent(c.index, c)
                    tools = tool_streams[c.index]
                    finished = c.finish_reason is not None
                    reasoning, text = thinking[c.index].feed(text or "", finished) if thinking else ("", text)
                    deltas = tools.feed(text or "", finished)
                    if reasoning:
                        deltas = [{"reasoning": reasoning, "reasoning_content": reasoning}, *deltas]
                    if not deltas and not logprobs and c.finish_reason is None:
                        continue  # (held back: the text of a tool call still being written)
                    deltas = deltas or [{}]
                    reason = finish_reason(c.finish_reason, tools.num_calls_sent > 0)
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        yield chunk([{"index": c.index, "delta": delta,
                                      "logprobs": logprobs if i == 0 else None,
                                      "finish_reason": reason if last else None,
                                      "stop_reason": c.stop_reason if last and reason else None}],
                                    req.continuous_usage)
        if req.include_usage:
            yield chunk([], True)
    except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
        yield sse(engine_error(e).body())
    yield sse("[DONE]")

