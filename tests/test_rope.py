"""Every rope scaling's cos/sin table equals transformers' own rope functions."""

from __future__ import annotations

import pytest
import torch

from omniinfer.models.layers.rotary import rope_tables

HEAD = 16
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD // 2)],
                 "long_factor": [2.0 + 0.3 * i for i in range(HEAD // 2)]},
}


def _hf_rows(name: str, scaling: dict, positions: list[int], max_position: int):
    """transformers' cos/sin for each position, as it rotates that token while decoding
    (a sequence of position + 1 tokens)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=HEAD * 4, num_attention_heads=4, max_position_embeddings=max_position,
                         rope_parameters={**scaling, "rope_theta": 10000.0})
    cos, sin = [], []
    for p in positions:
        kwargs = {"seq_len": p + 1} if name in ("dynamic", "longrope") else {}
        inv_freq, attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", **kwargs)
        freqs = p * inv_freq.float()
        cos.append(freqs.cos() * attention)
        sin.append(freqs.sin() * attention)
    return torch.stack(cos), torch.stack(sin)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_tables_match_transformers(name):
    scaling, max_position = SCALINGS[name], 64
    num_positions = 128
    cos, sin = rope_tables(HEAD, num_positions, 10000.0, dict(scaling), max_position)
    positions = [0, 1, 5, 31, 32, 33, 63, 64, 100, 127]
    hf_cos, hf_sin = _hf_rows(name, scaling, positions, max_position)
    torch.testing.assert_close(cos[positions], hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[positions], hf_sin, rtol=1e-5, atol=1e-5)


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="'ntk-by-parts' is not supported; supported: default"):
        rope_tables(HEAD, 8, 10000.0, {"rope_type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ValueError, match="'linear' needs 'factor'"):
        rope_tables(HEAD, 8, 10000.0, {"rope_type": "linear"})


def test_layers_share_one_table_and_different_scalings_do_not():
    """Every layer asking for the same table gets the same tensors (24 copies were 12 MiB for the
    medium model); another scaling, theta or length is a table of its own."""
    from omniinfer.models.layers.rotary import RotaryEmbedding

    layers = [RotaryEmbedding(HEAD, 64, 10000.0, dict(SCALINGS["linear"]), 128) for _ in range(3)]
    assert len({layer.cos.data_ptr() for layer in layers}) == 1
    assert len({layer.sin.data_ptr() for layer in layers}) == 1
    others = [RotaryEmbedding(HEAD, 64, 10000.0, dict(SCALINGS["yarn"]), 128),
              RotaryEmbedding(HEAD, 64, 500000.0, dict(SCALINGS["linear"]), 128),
              RotaryEmbedding(HEAD, 64, 10000.0, dict(SCALINGS["linear"]), 256)]
    assert len({t.cos.data_ptr() for t in [layers[0], *others]}) == 4
    cos, _ = rope_tables(HEAD, 128, 10000.0, dict(SCALINGS["linear"]), 64)
    torch.testing.assert_close(layers[0].cos, cos, rtol=0, atol=0)


@pytest.mark.parametrize("head,factor", [(16, 0.75), (96, 0.75), (128, 0.5), (64, 1.0)])
def test_a_partial_rotary_turns_what_transformers_turns(head, factor):
    """The torch op against transformers' Phi-3 rotary (which turns the first head * factor
    features of each head and passes the rest), on a table of rotary_dim() features."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS
    from omniinfer.models.layers.rotary import RotaryEmbedding, rotary_dim

    dim = rotary_dim({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": factor}}, head)
    assert dim == int(head * factor)
    rope = RotaryEmbedding(head, 64, 10000.0, None, 64, rotary_dim=dim)
    assert rope.cos.shape == (64, dim // 2)
    gen = torch.Generator().manual_seed(head)
    positions = torch.tensor([0, 3, 17, 63, 40])
    q, k = torch.randn(5, 4 * head, generator=gen), torch.randn(5, 2 * head, generator=gen)
    got_q, got_k = TORCH_LAYER_OPS.rotary(positions, q.clone(), k.clone(), rope.cos, rope.sin, head)
    cos = torch.cat([rope.cos[positions]] * 2, -1)[None]  # transformers' [batch, T, rotary_dim]
    sin = torch.cat([rope.sin[positions]] * 2, -1)[None]
    want_q, want_k = apply_rotary_pos_emb(q.view(1, 5, 4, head).transpose(1, 2),
                                          k.view(1, 5, 2, head).transpose(1, 2), cos, sin)
    torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(5, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(5, -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q.view(5, 4, head)[..., dim:], q.view(5, 4, head)[..., dim:])


@pytest.mark.parametrize("factor", [0.0, 1.5, 0.7, "half", None])
def test_a_bad_partial_rotary_factor_is_refused_by_name(factor):
    from omniinfer.models.layers.rotary import rotary_dim

    with pytest.raises(ValueError, match=rf"partial_rotary_factor={factor!r} turns -?\d+ of each 16-wide head; "
                                         r"expected a factor in \(0, 1\] that makes an even number"):
        rotary_dim({"partial_rotary_factor": factor}, 16)
