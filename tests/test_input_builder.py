"""The input builder's tensors for a mixed batch, checked against values written by hand; its
input is the scheduler's plain data (a SchedulerOutput), nothing of the engine's."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.sampling.metadata import SeqStates
from omniinfer.sampling.params import SamplingParams
from omniinfer.step import NewSeq, SchedulerOutput
from omniinfer.worker.input_builder import ModelRunnerInputBuilder
from omniinfer.worker.model_input import ModelInput, WorkerInput

BS = 4


def schedule(entries, num_prefills, prompt_logprobs=None, params=None):
    """entries: (seq_id, all tokens, computed, new tokens, block table, samples), batch order."""
    sched = SchedulerOutput(num_prefills=num_prefills, prompt_logprobs=prompt_logprobs or {})
    for seq_id, tokens, computed, num_new, table, samples in entries:
        sched.seq_ids.append(seq_id)
        sched.token_ids += tokens[computed:computed + num_new]
        sched.num_scheduled_tokens.append(num_new)
        sched.num_computed_tokens.append(computed)
        sched.block_tables.append(table)
        sched.num_samples.append(samples)
        sched.new_seqs.append(NewSeq(seq_id, f"r{seq_id}", 0, params or SamplingParams(), tokens, []))
    return sched


def build(sched):
    states = SeqStates()
    states.update(sched)
    return ModelRunnerInputBuilder(AttentionMetadataBuilder(BS), BS).build(sched, states), states


def test_mixed_batch_tensors():
    # A: fresh prompt of 5 tokens, all scheduled (samples). blocks [7, 3]
    # B: prompt of 10 with 4 computed, a chunk of 3 (does not sample). blocks [1, 2, 5]
    # C: a decode at position 6 (6 computed, 7 tokens). blocks [4, 6]
    mi, states = build(schedule([(0, [10, 11, 12, 13, 14], 0, 5, [7, 3], 1),
                                 (1, list(range(20, 30)), 4, 3, [1, 2, 5], 0),
                                 (2, [40, 41, 42, 43, 44, 45, 46], 6, 1, [4, 6], 1)], 2))
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
    assert mi.sampling_metadata.seqs == [states[0], states[2]]
    assert mi.sampling_metadata.seq_ids == [0, 2]
    # views of each stage
    pre, dec = md.prefill_metadata, md.decode_metadata
    assert pre.seq_lens == [5, 7] and pre.slot_mapping.tolist() == [28, 29, 30, 31, 12, 8, 9, 10]
    assert dec.seq_lens == [7] and dec.query_start_loc.tolist() == [0, 1]
    assert dec.block_tables.tolist() == [[4, 6, 0]] and dec.num_prefills == 0
    # the common description the backend's metadata was built from
    assert mi.common.positions is mi.input_positions and mi.common.num_prefills == 2


def test_prompt_logprob_rows_and_forks():
    params = SamplingParams(n=3, prompt_logprobs=1)
    tokens = [10, 11, 12, 13, 14, 15]
    # first chunk: positions 0..3 predict tokens 1..4
    mi, _ = build(schedule([(0, tokens, 0, 4, [0, 1], 0)], 1, {0: 1}, params))
    md = mi.sampling_metadata
    assert md.seqs == [] and mi.logits_indices.tolist() == [0, 1, 2, 3]
    assert md.prompt_rows[0].target_ids == [11, 12, 13, 14] and md.prompt_rows[0].first_target == 1
    # last chunk: position 4 predicts 15 (entries 0..4 collected); the request forks into n=3 here
    mi, states = build(schedule([(0, tokens, 4, 2, [0, 1], 3)], 1, {0: 5}, params))
    md = mi.sampling_metadata
    assert md.seqs == [states[0]] and md.num_samples == [3]
    assert mi.logits_indices.tolist() == [1, 0]
    assert md.prompt_rows[0].target_ids == [15] and md.prompt_rows[0].start_row == 1


def test_drafted_decodes_join_the_prefills():
    """Two decodes, the second drafted for: it scores its token and two drafts in one pass (three
    query rows, after the prefills), and samples through its spec rows."""
    sched = schedule([(0, [1, 2, 3], 0, 3, [0], 1), (1, [4, 5, 6], 2, 1, [1], 1),
                      (2, [7, 8, 9], 2, 1, [2, 3], 1)], 1)
    states = SeqStates()
    states.update(sched)
    mi = ModelRunnerInputBuilder(AttentionMetadataBuilder(BS), BS).build(
        sched, states, {2: ([30, 31], None)})
    assert mi.input_tokens.tolist() == [1, 2, 3, 9, 30, 31, 6]
    md = mi.attn_metadata
    assert (md.num_prefills, md.query_lens, md.seq_lens) == (2, [3, 3, 1], [3, 5, 3])
    sampling = mi.sampling_metadata
    assert sampling.seq_ids == [0, 1] and [r.seq.seq_id for r in sampling.spec_rows] == [2]
    assert sampling.spec_rows[0].start_row == 2 and sampling.spec_rows[0].draft_tokens == [30, 31]
    assert mi.logits_indices.tolist() == [2, 6, 3, 4, 5]


def test_broadcast_dict_round_trips_every_field():
    mi, _ = build(schedule([(0, [1, 2, 3, 4, 5], 0, 5, [2, 3], 1), (1, [7, 8, 9], 2, 1, [1], 1)], 1))
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
