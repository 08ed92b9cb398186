"""The OpenAI-compatible HTTP server (`omniinfer serve`).

    api_server.py          FastAPI app: routes, auth, errors, health, metrics
    run.py                 `run_server`: uvicorn, model loading, graceful shutdown, exit status
    http_guard.py          body limit, JSON parsing off the loop, the 500 of last resort, 414/431
    limits.py              ServerLimits: the operator's per-request limits (--max-n, ...)
    async_engine.py        AsyncLLMEngine: a thread steps LLMEngine; requests stream back
    protocol.py            request/response models and their mapping to SamplingParams
    serving_completion.py  POST /v1/completions (whole or streamed)
    serving_chat.py        POST /v1/chat/completions (chat template, whole or streamed)
    metrics.py             Prometheus metrics and the periodic stats log line
"""
