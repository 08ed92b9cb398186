"""POST /v1/completions: one engine request per prompt, answered whole or as SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from omniinfer.entrypoints.openai.protocol import CompletionRequest, now, random_id, usage
from omniinfer.entrypoints.openai.serving_common import (
    ServingContext,
    StreamProgress,
    completion_logprobs,
    engine_error,
    merge,
    output_error,
    sse,
)
from omniinfer.entrypoints.openai.structured import constrain


async def create_completion(ctx: ServingContext, req: CompletionRequest) -> dict | AsyncIterator[str]:
    """The response body, or (stream=true) an iterator of SSE events ending with [DONE].

    Everything that can be checked is checked before any prompt is queued, so a bad request
    is a 400 that never reaches the engine."""
    ctx.check_request(req)
    params = req.sampling_params(max_tokens=req.max_tokens, logprobs=req.logprobs,
                                 defaults=ctx.generation_defaults)
    constrain(ctx, req, params)
    inputs = [await ctx.prompt_input(p) for p in req.prompts(ctx.max_prompt_tokens)]
    for prompt_input in inputs:
        ctx.check_length(prompt_input, params)
    request_id = random_id("cmpl")
    streams = [ctx.generate(f"{request_id}-{i}", p, params) for i, p in enumerate(inputs)]
    if req.stream:
        return _stream(ctx, req, request_id, inputs, streams)
    return await _full(ctx, req, request_id, inputs, streams)


def _echo(ctx: ServingContext, prompt_input: dict) -> str:
    text = prompt_input["prompt"]
    return text if text is not None else ctx.tokenizer.decode(prompt_input["prompt_token_ids"])


async def _full(ctx, req, request_id, inputs, streams) -> dict:
    final = [None] * len(streams)
    try:
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                final[i] = out
    except Exception as e:  # noqa: BLE001 - answered as an OpenAI error
        raise engine_error(e) from None
    choices = []
    for i, out in enumerate(final):
        if (error := output_error(out)) is not None:
            raise error
        prefix = _echo(ctx, inputs[i]) if req.echo else ""
        for c in out.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [],
                                               req.logprobs, len(prefix))
            choices.append({"index": i * req.n + c.index, "text": prefix + c.text,
                            "logprobs": logprobs, "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason})
    num_prompt = sum(len(p["prompt_token_ids"]) for p in inputs)
    num_completion = sum(len(c.token_ids) for out in final for c in out.outputs)
    return {"id": request_id, "object": "text_completion", "created": now(),
            "model": ctx.model_name, "choices": choices, "usage": usage(num_prompt, num_completion)}


async def _stream(ctx, req, request_id, inputs, streams) -> AsyncIterator[str]:
    num_prompt = sum(len(p["prompt_token_ids"]) for p in inputs)
    progress = StreamProgress(request_id, "text_completion", ctx.model_name, num_prompt,
                              req.include_usage, now())
    chunk = progress.chunk

    try:
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                if (error := output_error(out)) is not None:
                    raise error
                for c in out.outputs:
                    index = i * req.n + c.index
                    news = progress.news(index, c, req.logprobs is not None)
                    if news is None:
                        continue
                    text, new_ids, start_text, start_tokens = news
                    prefix = _echo(ctx, inputs[i]) if req.echo and index not in progress.sent_text else ""
                    logprobs = None
                    if req.logprobs is not None:
                        steps = (c.logprobs or [])[start_tokens:start_tokens + len(new_ids)]
                        offset = start_text + (len(_echo(ctx, inputs[i])) if req.echo else 0)
                        logprobs = completion_logprobs(ctx.tokenizer, new_ids, steps, req.logprobs,
                                                       offset)
                    progress.sent(index, c)
                    yield chunk([{"index": index, "text": prefix + text, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason if c.finish_reason else None}],
                                req.continuous_usage)
        if req.include_usage:
            yield chunk([], True)
    except Exception as e:  # noqa: BLE001 - the stream has started: report it in-band
        yield sse(engine_error(e).body())
    yield sse("[DONE]")
