"""GPTQ, AWQ and compressed-tensors layer formats (omniinfer.quantization.int_*): configs,
the bit layouts, reference dequantization, the kernels' layout, tensor-parallel shards.

References: compressed-tensors' own packer and compressors (the test extra installs the
package); for GPTQ and AWQ, whose packages do not install here (GPTQModel needs torch>=2.14,
AutoAWQ pulls `datasets` and no longer imports with this transformers), weights quantized by
GPTQ's published round-to-nearest rule and laid out by the documented bit layouts
(omniinfer.testing.quant_weights), with the expected weight taken from the integer codes,
plus words written out by hand from the layouts.
"""

from __future__ import annotations

import pytest
import torch

from omniinfer.quantization.int_formats import (
    AWQConfig,
    CompressedTensorsConfig,
    GPTQConfig,
    parse_quantization_config,
)
from omniinfer.quantization.int_layouts import check_tensors
from omniinfer.quantization.int_packing import pack_int32, unpack_int32
from omniinfer.quantization.int_sharding import apply_plan, tp_range
from omniinfer.testing import quant_weights as qw

OUT, IN = 64, 256


def gptq(**kw):
    return parse_quantization_config(dict(quant_method="gptq", **kw)).layer_format("m.down_proj")


def awq(**kw):
    cfg = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="GEMM")
    return parse_quantization_config({**cfg, **kw}).layer_format("m.down_proj")


def ct(bits=4, strategy="group", group_size=128, symmetric=True, actorder=None, acts=None,
       fmt=None):
    weights = dict(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                   group_size=group_size, actorder=actorder, dynamic=False, observer="minmax")
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group},
              "format": fmt or ("pack-quantized" if acts is None else "int-quantized"),
              "ignore": ["lm_head"], "quantization_status": "compressed"}
    return parse_quantization_config(config).layer_format("model.layers.0.mlp.up_proj")


def weight(out=OUT, inp=IN, seed=0):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


# ---- configs -----------------------------------------------------------------------------------
def test_configs_as_the_tools_write_them():
    c = parse_quantization_config({"bits": 4, "group_size": 128, "damp_percent": 0.01,
                                   "desc_act": True, "sym": False, "true_sequential": True,
                                   "quant_method": "gptq", "checkpoint_format": "gptq_v2"})
    assert c == GPTQConfig(4, 128, False, True, "gptq_v2")
    a = parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                   "zero_point": True, "version": "GEMM",
                                   "modules_to_not_convert": ["visual"]})
    assert a == AWQConfig(4, 64, True, "gemm", ("visual",))
    assert a.layer_format("model.visual") is None and a.layer_format("lm_head") is None
    w8a8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                            "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                      "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}
    cfg = parse_quantization_config(w8a8)
    assert isinstance(cfg, CompressedTensorsConfig)
    assert cfg.layer_format("model.layers.1.mlp.gate") is None
    assert cfg.layer_format("model.layers.1.mlp.down_proj").__class__.__name__ == "CTInt8Format"
    assert cfg.scheme_for("lm_head") is None


@pytest.mark.parametrize("config, message", [
    (dict(quant_method="gptq", bits=3), "(gptq): bits=3 is not supported; supported: (4, 8)"),
    (dict(quant_method="gptq", group_size=256), "group_size=256 is not supported; supported: "
                                                "(32, 64, 128, -1)"),
    (dict(quant_method="gptq", checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    (dict(quant_method="gptq", dynamic={"-:.*": {}}), "dynamic="),
    (dict(quant_method="awq", version="gemv"), "(awq): version='gemv' is not supported; "
                                               "supported: ('gemm',)"),
    (dict(quant_method="awq", zero_point=False), "zero_point=False"),
    (dict(quant_method="bitsandbytes"), "quant_method='bitsandbytes' is not supported; "
                                        "supported: ['awq', 'compressed-tensors', 'fp8', 'gptq']"),
    (dict(quant_method="fp8", weight_block_size=[0, 128]), "(fp8): weight_block_size=[0, 128] is not supported"),
    (dict(quant_method="fp8", activation_scheme="per-group"),
     "activation_scheme='per-group' is not supported; supported: ('dynamic', 'static')"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}),
     "weights.block_structure=None is not supported; supported: [rows, columns] with strategy block"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 16}}}),
     "weights.strategy='group' is not supported; supported: ('channel', 'tensor', 'block')"),
    (dict(quant_method="compressed-tensors", format="pack-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 2, "strategy": "group",
                                           "group_size": 128}}}),
     "config_groups.g): weights.num_bits=2 is not supported; supported: (4, 8)"),
    (dict(quant_method="compressed-tensors", format="int-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": False}}}),
     "input_activations.(strategy, dynamic)=('token', False)"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8}}}),
     "weights.(type, num_bits)=('int', 8) is not supported; supported: ('float', 8) with float-quantized"),
    (dict(quant_method="compressed-tensors", quantization_status="frozen", config_groups={"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}}),
     "quantization_status='frozen'"),
])
def test_unsupported_configs_name_the_field_the_value_and_what_is_supported(config, message):
    with pytest.raises(ValueError) as e:
        parse_quantization_config(config)
    assert message in str(e.value)


# ---- bit layouts, written out by hand from the formats' descriptions ----------------------------
def test_words_hold_codes_in_the_documented_order():
    # GPTQ qweight: code of input row 8r + j at bits 4j of word [r, n]
    codes = torch.arange(8).repeat(2, 1).t()  # [8 inputs, 2 outputs]: input j has code j
    assert pack_int32(codes, 4, 0).tolist() == [[0x76543210, 0x76543210]]
    # a top code >= 8 makes the word negative as int32; reading masks it back
    word = torch.tensor([[-0x789ABCE0 + 0]], dtype=torch.int32)  # 0x87654320 as int32
    assert unpack_int32(word, 4, 1, 8).tolist() == [[0, 2, 3, 4, 5, 6, 7, 8]]
    # AWQ: slot i of a word holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i]: columns
    # 0..7 with codes 0..7 pack as nibbles 0,2,4,6,1,3,5,7 from the low end
    q = qw.Quantized(codes=torch.arange(8)[:, None], scales=torch.ones(1, 8),
                     zeros=torch.zeros(1, 8, dtype=torch.int64),
                     g_idx=torch.zeros(1, dtype=torch.int64), expected=None)
    t = qw.awq_tensors(q)
    assert t["qweight"].tolist() == [[0x75316420]]
    assert awq().dequantize(t | {"scales": torch.ones(1, 8)}, 8, 1).flatten().tolist() == list(range(8))
    # 8-bit: four codes a word, low byte first
    assert pack_int32(torch.tensor([[1, 2, 3, 0xFF]]), 8, 1).tolist() == [[-0x00FCFDFF]]


def test_packing_matches_compressed_tensors_own_packer():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for bits, cols in ((4, 64), (4, 37), (8, 64), (8, 13)):
        signed = torch.randint(-(1 << bits - 1), 1 << bits - 1, (6, cols), dtype=torch.int8)
        for dim in (0, 1):
            value = signed if dim == 1 else signed.t().contiguous()
            ours = pack_int32(value.to(torch.int64) + (1 << bits - 1), bits, dim)
            assert torch.equal(ours, helpers.pack_to_int32(value, bits, packed_dim=dim))


# ---- dequantization against the independent construction -------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym, desc_act, v1", [(True, False, True), (False, False, True),
                                               (False, True, False), (True, True, False)])
def test_gptq(bits, group_size, sym, desc_act, v1):
    q = qw.rtn(weight(), bits, group_size, sym, act_order=desc_act)
    fmt = gptq(bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
               checkpoint_format="gptq" if v1 else "gptq_v2")
    tensors = qw.gptq_tensors(q, bits, v1)
    check_tensors(fmt, tensors, OUT, IN)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), q.expected)
    packed = fmt.to_kernel_layout(tensors, OUT, IN)
    assert torch.equal(packed.dequantize(), q.expected)
    # one group: act-order changes nothing the kernels see
    assert (packed.zeros is None) == sym
    assert (packed.g_idx is None) == (not desc_act or group_size == -1)


def test_gptq_v1_reads_a_stored_15_as_zero_16():
    q = qw.rtn(weight(), 4, 128, sym=False)
    tensors = qw.gptq_tensors(q, 4, v1=True)
    tensors["qzeros"] = torch.full_like(tensors["qzeros"], -1)  # every nibble 15
    expected = (q.codes.t().float() - 16) * q.scales.float()[q.g_idx]
    fmt = gptq(bits=4, group_size=128, sym=False)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), expected.t())
    assert torch.equal(fmt.to_kernel_layout(tensors, OUT, IN).dequantize(), expected.t())


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_awq(group_size):
    q = qw.rtn(weight(), 4, group_size, sym=False)
    fmt, tensors = awq(group_size=group_size), qw.awq_tensors(q)
    check_tensors(fmt, tensors, OUT, IN)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), q.expected)
    assert torch.equal(fmt.to_kernel_layout(tensors, OUT, IN).dequantize(), q.expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy, group_size", [("group", 32), ("group", 128), ("channel", None)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized_against_its_compressor(bits, strategy, group_size,
                                                                 symmetric):
    base = pytest.importorskip("compressed_tensors.compressors.pack_quantized.base")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = weight().to(torch.bfloat16)
    q = qw.rtn(w, bits, group_size or -1, symmetric, scale_dtype=torch.bfloat16)
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, strategy=strategy,
                            group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": w, "weight_scale": q.scales.t().contiguous()}
    if not symmetric:
        state["weight_zero_point"] = (q.zeros.t() - (1 << bits - 1)).to(torch.int8).contiguous()
    compressed = base.PackedQuantizationCompressor.compress(state, scheme)
    reference = base.PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    fmt = ct(bits, strategy, group_size, symmetric)
    check_tensors(fmt, compressed, OUT, IN)
    ours = fmt.dequantize(compressed, OUT, IN)
    assert torch.equal(ours.to(reference.dtype), reference)
    assert torch.equal(fmt.to_kernel_layout(compressed, OUT, IN).dequantize(), ours)
    # and the independent construction
    tensors = qw.ct_packed_tensors(q, bits, symmetric)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), q.expected)


def test_compressed_tensors_actorder_group_and_a_ragged_input():
    q = qw.rtn(weight(inp=200), 4, 32, sym=False, act_order=True)
    fmt = ct(4, "group", 32, symmetric=False, actorder="group")
    tensors = qw.ct_packed_tensors(q, 4, sym=False, g_idx=True)
    check_tensors(fmt, tensors, OUT, 200)
    assert torch.equal(fmt.dequantize(tensors, OUT, 200), q.expected)
    packed = fmt.to_kernel_layout(tensors, OUT, 200)
    assert packed.qweight.shape == (25, OUT) and packed.g_idx is not None
    assert torch.equal(packed.dequantize(), q.expected)


@pytest.mark.parametrize("static", [False, True])
def test_compressed_tensors_w8a8_against_its_compressor(static):
    base = pytest.importorskip("compressed_tensors.compressors.naive_quantized.base")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    acts = dict(num_bits=8, symmetric=True, strategy="tensor" if static else "token",
                dynamic=not static)
    w = weight().to(torch.bfloat16)
    tensors, expected = qw.ct_int8_tensors(w, 0.05 if static else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, symmetric=True, strategy="channel"), input_activations=QuantizationArgs(**acts))
    compressed = base.IntQuantizationCompressor.compress(
        {"weight": w, "weight_scale": tensors["weight_scale"]}, scheme)
    # (its codes can differ by one from ours: it divides in bfloat16)
    reference = base.IntQuantizationCompressor.decompress(compressed, scheme)["weight"]
    fmt = ct(8, "channel", None, acts=acts)
    check_tensors(fmt, tensors, OUT, IN)
    theirs = tensors | {"weight": compressed["weight"]}
    assert torch.equal(fmt.dequantize(theirs, OUT, IN).to(reference.dtype), reference)
    assert torch.equal(fmt.dequantize(tensors, OUT, IN), expected)
    int8 = fmt.to_kernel_layout(tensors, OUT, IN)
    assert int8.weight_scale.shape == (OUT,) and (int8.input_scale is not None) == static


def test_a_missing_or_misshapen_tensor_is_named():
    q = qw.rtn(weight(), 4, 128, sym=True)
    fmt, tensors = gptq(bits=4, group_size=128, desc_act=True), qw.gptq_tensors(q, 4)
    with pytest.raises(ValueError, match=r"m.down_proj \(gptq, 64x256\): the checkpoint has no "
                                         r"tensor 'qzeros' \(expected shape \(2, 8\)\)"):
        check_tensors(fmt, {k: v for k, v in tensors.items() if k != "qzeros"}, OUT, IN,
                      "m.down_proj")
    with pytest.raises(ValueError, match=r"tensor 'scales' has shape \(2, 32\), expected \(2, 64\)"):
        check_tensors(fmt, tensors | {"scales": tensors["scales"][:, :32]}, OUT, IN)
    with pytest.raises(ValueError, match=r"tensor 'qweight' has dtype torch.int64"):
        check_tensors(fmt, tensors | {"qweight": tensors["qweight"].long()}, OUT, IN)


# ---- tensor parallelism ------------------------------------------------------------------------
CASES = {
    "gptq g128": (lambda: gptq(bits=4, group_size=128, sym=False),
                  lambda w: qw.gptq_tensors(qw.rtn(w, 4, 128, False), 4), 128),
    "gptq 8-bit g32 desc_act": (lambda: gptq(bits=8, group_size=32, sym=False, desc_act=True),
                                lambda w: qw.gptq_tensors(qw.rtn(w, 8, 32, False, True), 8), 32),
    "gptq channel": (lambda: gptq(bits=4, group_size=-1),
                     lambda w: qw.gptq_tensors(qw.rtn(w, 4, -1, True), 4), -1),
    "awq g64": (lambda: awq(group_size=64), lambda w: qw.awq_tensors(qw.rtn(w, 4, 64, False)), 64),
    "ct w4a16 asym g32": (lambda: ct(4, "group", 32, symmetric=False),
                          lambda w: qw.ct_packed_tensors(qw.rtn(w, 4, 32, False), 4, False), 32),
    "ct w4a16 actorder": (lambda: ct(4, "group", 64, symmetric=True, actorder="group"),
                          lambda w: qw.ct_packed_tensors(qw.rtn(w, 4, 64, True, True), 4, True,
                                                         g_idx=True), 64),
    "ct w8a16 channel": (lambda: ct(8, "channel", None, symmetric=False),
                         lambda w: qw.ct_packed_tensors(qw.rtn(w, 8, -1, False), 8, False), -1),
    "ct w8a8": (lambda: ct(8, "channel", None, acts=dict(num_bits=8, strategy="token",
                                                        dynamic=True)),
                lambda w: qw.ct_int8_tensors(w)[0], -1),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_dequantize_to_the_slices_of_the_whole(case, world_size):
    make_fmt, make_tensors, group_size = CASES[case]
    if case.endswith("desc_act") or case.endswith("actorder"):
        group_size = -1  # scales are whole under an input split: no group can be cut
    fmt, tensors = make_fmt(), make_tensors(weight())
    whole = fmt.dequantize(tensors, OUT, IN)
    for rank in range(world_size):
        for split, total in (("out", OUT), ("in", IN)):
            start, length = tp_range(total, rank, world_size)
            if split == "in" and group_size > 0 and length % group_size:
                with pytest.raises(ValueError, match="cuts a quantization group"):
                    fmt.shard_plan(split, start, length, OUT, IN)
                continue
            shard = apply_plan(tensors, fmt.shard_plan(split, start, length, OUT, IN))
            out, inp = (length, IN) if split == "out" else (OUT, length)
            expected = whole.narrow(0 if split == "out" else 1, start, length)
            assert torch.equal(fmt.dequantize(shard, out, inp), expected), (split, rank)
            if not case.endswith("w8a8"):
                assert torch.equal(fmt.to_kernel_layout(shard, out, inp).dequantize(), expected)


def test_splits_that_cut_a_group_or_a_word_are_refused():
    fmt = gptq(bits=4, group_size=128)
    with pytest.raises(ValueError, match=r"m.o \(gptq\): the tensor-parallel split \[0, 64\) of "
                                         r"its 256 features cuts a quantization group "
                                         r"\(group_size 128, tensor qzeros\) of 128 in two"):
        fmt.shard_plan("in", 0, 64, OUT, IN, layer="m.o")
    with pytest.raises(ValueError, match="cuts a packed int32 word of 8 codes"):
        fmt.shard_plan("out", 4, 8, OUT, IN)  # qzeros hold 8 outputs a word
    with pytest.raises(ValueError, match="cuts a packed int32 word of 8 codes"):
        awq(group_size=32).shard_plan("out", 0, 12, OUT, IN)
    # desc_act or one group per channel: any multiple of the word splits the inputs
    assert gptq(bits=4, group_size=128, desc_act=True).shard_plan("in", 0, 64, OUT, IN)["scales"] is None
    assert gptq(bits=4, group_size=-1).shard_plan("in", 64, 64, OUT, IN)["qzeros"] is None
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        tp_range(256, 0, 3)
