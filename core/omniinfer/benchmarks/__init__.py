"""Reusable measurement cores behind `omniinfer bench`.

    offline.py       throughput and latency of the engine in-process (the `LLM` API)
    serve_client.py  a streaming client load against a running server: req/s, TTFT, ITL
    stats.py         percentiles and the printed tables

Each returns a plain dict of numbers, so scripts (and the fuller benchmarks/ suite) can
reuse them and print or store results however they like.
"""
