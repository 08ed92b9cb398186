"""The input builder's tensors for a mixed batch, checked against values written by hand."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.engine.scheduler import ScheduledSeq
from omniinfer.engine.sequence import Sequence, SequenceGroup
from omniinfer.sampling.params import SamplingParams
from omniinfer.worker.input_builder import ModelRunnerInputBuilder
from omniinfer.worker.model_input import ModelInput, WorkerInput

BS = 4


def seq_with(seq_id, tokens, computed, params=None):
    group = SequenceGroup(f"r{seq_id}", None, list(tokens), params or SamplingParams())
    seq = Sequence(seq_id, group, 0, list(tokens), len(tokens), BS)
    seq.num_computed_tokens = computed
    group.seqs.append(seq)
    return seq


def build(entries):
    builder = ModelRunnerInputBuilder(AttentionMetadataBuilder(BS))
    for sched, table in entries:
        builder.add_seq(sched, table)
    return builder.build()


def test_mixed_batch_tensors():
    # A: fresh prompt of 5 tokens, all scheduled (samples). blocks [7, 3]
    a = seq_with(0, [10, 11, 12, 13, 14], 0)
    # B: prompt of 10 with 4 computed, a chunk of 3 (does not sample). blocks [1, 2, 5]
    b = seq_with(1, list(range(20, 30)), 4)
    # C: a decode at position 6 (6 computed, 7 tokens). blocks [4, 6]
    c = seq_with(2, [40, 41, 42, 43, 44, 45, 46], 6)
    mi = build([(ScheduledSeq(a, 5), [7, 3]), (ScheduledSeq(b, 3), [1, 2, 5]),
                (ScheduledSeq(c, 1), [4, 6])])
    assert mi.input_tokens.tolist() == [10, 11, 12, 13, 14, 24, 25, 26, 46]
    assert mi.input_positions.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 6]
    md = mi.attn_metadata
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 8, 1)
    # slot = block * 4 + offset
    assert md.slot_mapping.tolist() == [28, 29, 30, 31, 12, 8, 9, 10, 26]
    assert md.seq_lens == [5, 7, 7] and md.query_lens == [5, 3, 1]
    assert md.context_lens_tensor.tolist() == [0, 4, 6]
    assert md.query_start_loc.tolist() == [0, 5, 8, 9]
    assert md.block_tables.tolist() == [[7, 3, 0], [1, 2, 5], [4, 6, 0]]
    assert (md.max_query_len, md.max_seq_len) == (5, 7)
    # logits for the last token of each sampling sequence only (B's chunk does not sample)
    assert mi.logits_indices.tolist() == [4, 8]
    assert mi.sampling_metadata.seqs == [a, c]
    # views of each stage
    pre, dec = md.prefill_metadata, md.decode_metadata
    assert pre.seq_lens == [5, 7] and pre.slot_mapping.tolist() == [28, 29, 30, 31, 12, 8, 9, 10]
    assert dec.seq_lens == [7] and dec.query_start_loc.tolist() == [0, 1]
    assert dec.block_tables.tolist() == [[4, 6, 0]] and dec.num_prefills == 0


def test_prompt_logprob_rows_and_forks():
    params = SamplingParams(n=3, prompt_logprobs=1)
    a = seq_with(0, [10, 11, 12, 13, 14, 15], 0, params)
    mi = build([(ScheduledSeq(a, 4), [0, 1])])  # first chunk: positions 0..3 predict tokens 1..4
    md = mi.sampling_metadata
    assert md.seqs == [] and mi.logits_indices.tolist() == [0, 1, 2, 3]
    assert md.prompt_rows[0].target_ids == [11, 12, 13, 14] and md.prompt_rows[0].first_target == 1
    a.num_computed_tokens = 4
    a.group.prompt_logprobs = [None, {}, {}, {}, {}]
    mi = build([(ScheduledSeq(a, 2), [0, 1])])  # last chunk: position 4 predicts 15; 5 samples
    md = mi.sampling_metadata
    assert md.seqs == [a] and md.num_samples == [3]  # the request forks into n=3 here
    assert mi.logits_indices.tolist() == [1, 0]
    assert md.prompt_rows[0].target_ids == [15] and md.prompt_rows[0].start_row == 1


def test_broadcast_dict_round_trips_every_field():
    a = seq_with(0, [1, 2, 3, 4, 5], 0)
    c = seq_with(1, [7, 8, 9], 2)
    mi = build([(ScheduledSeq(a, 5), [2, 3]), (ScheduledSeq(c, 1), [1])])
    values = mi.as_broadcastable_tensor_dict()
    again = ModelInput.from_broadcasted_tensor_dict(values, type(mi.attn_metadata))
    for key in ("input_tokens", "input_positions", "logits_indices"):
        assert torch.equal(getattr(again, key), getattr(mi, key))
    for key, value in mi.attn_metadata.as_dict().items():
        other = getattr(again.attn_metadata, key)
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
    wi = WorkerInput(torch.tensor([[1, 2]]), torch.zeros(0, 2, dtype=torch.long), torch.tensor([[3, 4]]))
    back = WorkerInput.from_broadcasted_tensor_dict(wi.as_broadcastable_tensor_dict())
    assert all(torch.equal(getattr(back, k), getattr(wi, k)) for k in
               ("blocks_to_swap_in", "blocks_to_swap_out", "blocks_to_copy"))
