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
    prompt_logprobs_json,
    sse,
)
from omniinfer.entrypoints.openai.structured import constrain


async def create_completion(ctx: ServingContext, req: CompletionRequest) -> dict | AsyncIterator[str]:
    """The response body, or (stream=true) an iterator of SSE events ending with [DONE].

    Everything that can be checked is checked before any prompt is queued, so a bad request
    is a 400 that never reaches the engine."""
    ctx.check_request(req)
    # echo with max_tokens 0 returns the prompt alone (OpenAI's and vLLM's way of scoring a
    # text): the engine generates one token, which is dropped
    params = req.sampling_params(max_tokens=1 if req.echo_only else req.max_tokens,
                                 logprobs=req.logprobs, defaults=ctx.generation_defaults)
    constrain(ctx, req, params)
    inputs = [ctx.truncated(await ctx.prompt_input(p), params) for p in req.prompts(ctx.max_prompt_tokens)]
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


def _logprobs(ctx, req, prompt_input: dict, out, ids: list[int], steps: list, offset: int,
              echoed: bool) -> dict | None:
    """The choice's `logprobs`; `echoed`: the prompt's tokens come first (their log-probs
    from the request's prompt log-probs, the first null)."""
    if req.logprobs is None:
        return None
    if echoed:
        prompt_ids = prompt_input["prompt_token_ids"]
        ids = prompt_ids + ids
        steps = list(out.prompt_logprobs or [None] * len(prompt_ids)) + steps
    return completion_logprobs(ctx.tokenizer, ids, steps, req.logprobs, offset)


async def _full(ctx, req, request_id, inputs, streams) -> dict:
    final = [None] * len(streams)
    try:
        async with aclosing(merge(streams)) as merged:
            async for i, out in merged:
                final[i] = out
    except Exception as e:  # noqa: BLE001 - answered as an OpenAI error
        raise engine_error(e) from None
    choices = []
    num_completion = 0
    for i, out in enumerate(final):
        if (error := output_error(out)) is not None:
            raise error
        prefix = _echo(ctx, inputs[i]) if req.echo else ""
        for c in out.outputs:
            ids, steps = ([], []) if req.echo_only else (c.token_ids, c.logprobs or [])
            num_completion += len(ids)
            choices.append({
                "index": i * req.n + c.index, "text": prefix + ("" if req.echo_only else c.text),
                "logprobs": _logprobs(ctx, req, inputs[i], out, ids, steps, 0, req.echo),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(ctx.tokenizer, out.prompt_logprobs)})
    num_prompt = sum(len(p["prompt_token_ids"]) for p in inputs)
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
                    if req.echo_only:  # the prompt alone, once the request is over
                        if c.finish_reason is None or index in progress.finished:
                            continue
                        progress.finished.add(index)
                        yield chunk([{"index": index, "text": _echo(ctx, inputs[i]),
                                      "logprobs": _logprobs(ctx, req, inputs[i], out, [], [], 0, True),
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}],
                                    req.continuous_usage)
                        continue
                    news = progress.news(index, c, req.logprobs is not None)
                    if news is None:
                        continue
                    text, new_ids, start_text, start_tokens = news
                    first = req.echo and index not in progress.sent_text
                    prefix = _echo(ctx, inputs[i]) if first else ""
                    steps = (c.logprobs or [])[start_tokens:start_tokens + len(new_ids)]
                    offset = 0 if first else start_text + (len(_echo(ctx, inputs[i])) if req.echo else 0)
                    logprobs = _logprobs(ctx, req, inputs[i], out, new_ids, steps, offset, first)
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
