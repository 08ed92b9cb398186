"""The attention-backend conformance kit: one pytest suite any plugin runs in its own CI.

Run it for one platform (every backend that platform can run here is tested)::

    pytest --pyargs omniinfer.testing.conformance --omniinfer-platform cpu
    python -m omniinfer.testing.conformance --platform cuda [--backend FLASH_ATTN] [pytest args]

What it checks, per backend: numerics against the reference (prefill, decode, mixed batches,
chunked prefill over a paged prefix, GQA, block sizes, head sizes, sliding window), metadata
builder invariants, the KV write path (padding slots -1 for graph-capable backends), and greedy
parity with transformers through the whole engine. See docs/conformance.md.
"""
