"""Whether, and how large, a model's sliding layers get a KV pool of their own
(engine/kv_groups.py keeps it): decided from the configuration alone, so the scheduler and every
worker (which must not import the engine) reach the same answer."""

from __future__ import annotations


def max_step_tokens(scheduler_config) -> int:
    """The most tokens one sequence gets slots for in a step (its chunk and the slots reserved
    ahead of a decode)."""
    s = scheduler_config
    return s.max_num_batched_tokens + max(s.num_lookahead_slots, s.num_scheduler_steps - 1)


def window_pool_blocks(num_device_blocks: int, block_size: int, window: int, max_num_seqs: int,
                       step_tokens: int) -> int:
    """Blocks of the window pool: what `max_num_seqs` sequences hold at most (their window and
    the slots of one step), and never more than the full pool."""
    per_seq = -(-(window - 1) // block_size) + -(-step_tokens // block_size) + 1
    return min(num_device_blocks, max_num_seqs * per_seq)


def window_pool_plan(config, attn_backend, num_device_blocks: int) -> tuple[int, int] | None:
    """(window, window-pool blocks) when this engine keeps its sliding layers' blocks apart, or
    None when every layer keeps every block (`window_pool_refusal` says why)."""
    reason = window_pool_refusal(config, attn_backend)
    if reason is not None:
        return None
    m, s = config.model, config.scheduler
    window = m.sliding_window
    return window, window_pool_blocks(num_device_blocks, config.cache.block_size, window,
                                      s.max_num_seqs, max_step_tokens(s))


def window_pool_refusal(config, attn_backend) -> str | None:
    """Why the model's sliding layers keep every block (None: they keep only their windows)."""
    windows = config.model.layer_windows
    if all(w is None for w in windows):
        return "no sliding-window layer"
    if all(w is not None for w in windows):
        return "every layer slides (one pool; the window bounds attention only)"
    if not getattr(attn_backend, "supports_window_pool", False):
        return (f"attention backend {attn_backend.name} derives metadata from the block table "
                "(supports_window_pool is False)")
    if config.speculative is not None:
        return "speculative decoding (the draft model's cache shares the block table)"
    return None
