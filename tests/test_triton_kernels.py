"""The core's Triton kernels against the pure-torch reference: under Triton's interpreter on
the CPU (tests/conftest.py sets TRITON_INTERPRET=1 on machines without an accelerator, before
anything imports the kernels), compiled on a GPU where there is one.

Small shapes only: the interpreter is 600-3000x slower than torch.
"""

from __future__ import annotations

import random
import subprocess
import sys
import types

import pytest
import torch

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.attention.common import common_for
from omniinfer.attention.ops import write_to_kv_cache
from omniinfer.attention.reference import reference_paged_attention
from omniinfer.kernels import triton as triton_kernels

pytest.importorskip("triton")
from omniinfer.kernels.triton.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_prefill_attention,
)
from omniinfer.kernels.triton.reshape_and_cache import reshape_and_cache  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
INTERPRETED = triton_kernels.interpret_requested()
DEVICE = ("cpu" if INTERPRETED else "cuda" if torch.cuda.is_available()
          else "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu")


def make_batch(seqs, block_size, num_kv_heads, group, head_size, dtype, window=None, seed=0):
    """A cache whose contexts are filled, metadata for `seqs` ((context, query) per sequence;
    decodes last) over shuffled disjoint blocks, and this step's q/k/v (k and v as views of one
    fused projection, as the model passes them)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // block_size) for c, q in seqs]
    pool = list(range(sum(need) + 2))
    rng.shuffle(pool)
    builder = AttentionMetadataBuilder(block_size, window)
    step, context = [], []
    for (ctx, q), n in zip(seqs, need):
        table, pool = pool[:n], pool[n:]
        step.append((ctx, q, table))
        if ctx:
            context.append((0, ctx, table))
    cache = torch.zeros(2, sum(need) + 2, block_size, num_kv_heads, head_size, dtype=dtype)
    ctx_md = builder.build(common_for(context, block_size))
    kv = torch.randn(2, ctx_md.slot_mapping.numel(), num_kv_heads, head_size, generator=gen).to(dtype)
    write_to_kv_cache(kv[0], kv[1], cache, ctx_md.slot_mapping)
    md = builder.build(common_for(step, block_size)).to(DEVICE)
    cache = cache.to(DEVICE)
    num_tokens, heads = md.slot_mapping.numel(), num_kv_heads * group
    qkv = torch.randn(num_tokens, (heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    qkv = qkv.to(DEVICE)
    q, k, v = qkv.split([heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    return (cache, md, q.view(num_tokens, heads, head_size),
            k.view(num_tokens, num_kv_heads, head_size), v.view(num_tokens, num_kv_heads, head_size))


def run_kernels(cache, md, q, k, v, window=None):
    """Write, then prefill and decode launches over their parts, as the TRITON backend does."""
    reshape_and_cache(k, v, cache[0], cache[1], md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    n = md.num_prefill_tokens
    scale = q.shape[-1] ** -0.5
    if (p := md.prefill_metadata) is not None:
        paged_prefill_attention(out[:n], q[:n], cache[0], cache[1], p.block_tables,
                                p.seq_lens_tensor, p.query_start_loc, p.max_query_len, scale, window)
    if (d := md.decode_metadata) is not None:
        paged_decode_attention(out[n:], q[n:], cache[0], cache[1], d.block_tables,
                               d.seq_lens_tensor, scale, window)
    return out


def check(seqs, block_size=16, num_kv_heads=2, group=2, head_size=64, dtype=torch.float32,
          window=None, seed=0):
    cache, md, q, k, v = make_batch(seqs, block_size, num_kv_heads, group, head_size, dtype,
                                    window, seed)
    expected_cache = cache.clone()
    write_to_kv_cache(k, v, expected_cache, md.slot_mapping)
    out = run_kernels(cache, md, q, k, v, window)
    assert torch.equal(cache, expected_cache), "the write kernel stored something else"
    expected = reference_paged_attention(q, cache, md, head_size ** -0.5, window)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


MIXED = [(0, 11), (20, 5), (0, 1), (9, 1), (33, 1), (64, 1)]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batches_block_sizes_and_gqa(block_size, group):
    check(MIXED, block_size=block_size, group=group)


@pytest.mark.parametrize("head_size", [16, 80, 96, 128])
def test_head_sizes(head_size):
    check(MIXED, head_size=head_size, seed=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    check(MIXED, dtype=dtype, seed=2)


def test_long_chunks_span_several_query_tiles():
    check([(0, 70), (37, 40), (5, 1)], block_size=8, seed=3)


def test_multi_query_attention():
    check(MIXED, num_kv_heads=1, group=8, seed=4)


@pytest.mark.parametrize("window", [1, 6, 40])
def test_sliding_window(window):
    check([(50, 30)] + MIXED, window=window, seed=5)


def test_negative_slots_write_nothing():
    cache, md, q, k, v = make_batch([(5, 1), (9, 1), (1, 1)], 8, 2, 2, 32, torch.float32)
    before = cache.clone()
    slots = md.slot_mapping.clone()
    slots[1:] = -1
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    changed = (cache != before).any(-1).any(-1).nonzero().tolist()
    block, offset = divmod(int(slots[0]), 8)
    assert changed == [[0, block, offset], [1, block, offset]]


def test_decode_reads_only_device_tensors():
    """Padded decode rows (as a replayed graph sees them) do not disturb the real rows."""
    cache, md, q, k, v = make_batch([(7, 1), (30, 1)], 16, 2, 2, 32, torch.float32)
    reshape_and_cache(k, v, cache[0], cache[1], md.slot_mapping)
    padded_tables = torch.cat([md.block_tables, torch.zeros_like(md.block_tables[:2])])
    padded_lens = torch.cat([md.seq_lens_tensor,
                             torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)])
    padded_q = torch.cat([q, torch.zeros_like(q)])
    out = torch.empty_like(padded_q)
    paged_decode_attention(out, padded_q, cache[0], cache[1], padded_tables, padded_lens, 32 ** -0.5)
    expected = reference_paged_attention(q, cache, md, 32 ** -0.5)
    torch.testing.assert_close(out[:2], expected)


def test_input_checks_name_the_argument():
    cache, md, q, k, v = make_batch([(0, 3)], 8, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        q3 = torch.empty(3, 3, 16, device=DEVICE)
        paged_prefill_attention(q3, q3, cache[0], cache[1], md.block_tables, md.seq_lens_tensor,
                                md.query_start_loc, 3, 1.0)
    with pytest.raises(ValueError, match=r"^key must have a contiguous last dimension"):
        reshape_and_cache(k.transpose(1, 2).contiguous().transpose(1, 2), v, cache[0], cache[1],
                          md.slot_mapping)


# ---- when the kernels can run ------------------------------------------------------------
@pytest.mark.skipif(not INTERPRETED, reason="checks the interpreted set-up of CPU-only machines")
def test_unavailable_reasons_on_this_machine(monkeypatch):
    assert triton_kernels.unavailable_reasons("cpu") == []  # interpreted here
    reasons = triton_kernels.unavailable_reasons("cuda")
    assert reasons == ["TRITON_INTERPRET=1 makes triton interpret the kernels on the host; unset "
                       "it to run them compiled on cuda"]
    compiled = types.SimpleNamespace(INTERPRETED=False)
    monkeypatch.setitem(sys.modules, "omniinfer.kernels.triton.paged_attention", compiled)
    assert triton_kernels.unavailable_reasons("cpu") == [
        "the triton kernels were already loaded for a GPU (TRITON_INTERPRET was set after they "
        "were imported); set it before start"]


def test_cpu_without_the_interpreter_is_refused():
    code = ("from omniinfer.kernels.triton import unavailable_reasons as r; "
            "print(r('cpu')); print(r('cuda'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    assert out == ["['on the CPU triton runs only under its interpreter: set TRITON_INTERPRET=1 "
                   "before start (slow; for tests and debugging)']", "[]"]


def test_missing_triton_is_a_reason(monkeypatch):
    monkeypatch.setattr(triton_kernels.importlib.util, "find_spec", lambda name: None)
    assert triton_kernels.unavailable_reasons("cuda") == [
        "triton is not installed (pip install 'triton>=3.0')"]
