"""Each CPU kernel checked against torch without Python in the loop: kernel_driver/driver.c reads
cases written here, runs the kernels and writes their outputs back. Built with the kernels for
every x86 level this CPU runs (natively), and for aarch64 with NEON (Debian's
gcc-aarch64-linux-gnu) run under qemu-aarch64 (Debian's qemu-user): the same cases and the same
torch references on every level, so an Arm build is checked on an x86 machine. The driver is built
with the kernels' prefetch trace (-DOMNI_PREFETCH_TRACE, csrc/prefetch.h), which only marks the
lines prefetched: the same code otherwise, and the test of which lines a product prefetches."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess

import pytest
import torch
import torch.nn.functional as F

from omniinfer.models.layers.moe import reference_moe
from omniinfer_cpu.kernels import build, isa

DRIVER = os.path.join(os.path.dirname(__file__), "kernel_driver", "driver.c")
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
CROSS_SYSROOT = "/usr/aarch64-linux-gnu"
F32, BF16 = 0, 1
TORCH_DTYPE = {F32: torch.float32, BF16: torch.bfloat16}
TOL = {F32: dict(atol=1e-4, rtol=1e-4), BF16: dict(atol=3e-2, rtol=3e-2)}


# ---- the case file ------------------------------------------------------------------------------
def raw(t: torch.Tensor | None) -> bytes:
    if t is None:
        return b""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def write_cases(path, cases) -> None:
    with open(path, "wb") as f:
        f.write(b"OMNICASE" + struct.pack("<I", len(cases)))
        for name, ints, floats, arrays in cases:
            f.write(name.encode().ljust(32, b"\0"))
            f.write(struct.pack(f"<I{len(ints)}q", len(ints), *ints))
            f.write(struct.pack(f"<I{len(floats)}f", len(floats), *floats))
            f.write(struct.pack("<I", len(arrays)))
            for a in arrays:
                data = raw(a)
                f.write(struct.pack("<Q", len(data)) + data)


def read_arrays(path, like) -> list[list[torch.Tensor | None]]:
    """Every case's arrays as the kernels left them, shaped and typed as `like` (the inputs)."""
    out = []
    with open(path, "rb") as f:
        assert f.read(8) == b"OMNICASE"
        (n,) = struct.unpack("<I", f.read(4))
        for i in range(n):
            f.read(32)
            (ni,) = struct.unpack("<I", f.read(4))
            f.read(8 * ni)
            (nf,) = struct.unpack("<I", f.read(4))
            f.read(4 * nf)
            (na,) = struct.unpack("<I", f.read(4))
            arrays = []
            for a in range(na):
                (size,) = struct.unpack("<Q", f.read(8))
                data = bytearray(f.read(size))
                ref = like[i][a]
                if ref is None:
                    arrays.append(None)
                    continue
                dtype = torch.int16 if ref.dtype == torch.bfloat16 else ref.dtype
                t = torch.frombuffer(data, dtype=dtype).clone().reshape(ref.shape) if size else ref.new_empty(0)
                arrays.append(t.view(torch.bfloat16) if ref.dtype == torch.bfloat16 else t)
            out.append(arrays)
    return out


# ---- the drivers ---------------------------------------------------------------------------------
# levels between the lowest and the highest x86 ones: their driver runs in the slow tier (~12 s
# each; the kernels at those levels are also checked through Python in the default one)
MIDDLE_LEVELS = ("avx512", "avx512_vbmi")


def _driver_targets():
    out = []
    for level in isa.arch_levels():
        missing = isa.missing_flags(level)
        marks = [pytest.mark.skipif(bool(missing), reason=f"this CPU lacks {', '.join(missing)}, which the "
                                    f"{level.name} kernels need")]
        out.append(pytest.param(level.name, id=level.name,
                                marks=marks + ([pytest.mark.slow] if level.name in MIDDLE_LEVELS else [])))
    if isa.machine_arch() != "aarch64":
        why = None
        if shutil.which(CROSS_CC) is None:
            why = f"{CROSS_CC} is not installed (Debian: apt-get install gcc-aarch64-linux-gnu)"
        elif shutil.which(QEMU) is None:
            why = f"{QEMU} is not installed (Debian: apt-get install qemu-user)"
        out.append(pytest.param("neon", id="neon-qemu", marks=pytest.mark.skipif(why is not None, reason=why or "")))
    return out


@pytest.fixture(scope="module")
def drivers(tmp_path_factory):
    """level -> the command that runs that level's driver (built once)."""
    tmp = tmp_path_factory.mktemp("drivers")
    built = {}

    def get(name: str) -> list[str]:
        if name in built:
            return built[name]
        level = isa.BY_NAME[name]
        native = level.arch == isa.machine_arch()
        cc = (os.environ.get("CC") or "gcc") if native else CROSS_CC
        exe = str(tmp / f"driver-{name}")
        flags = ["-O3", "-std=gnu11", "-fopenmp", "-DOMNI_PREFETCH_TRACE", *level.cflags]
        error = isa.compile_and_link(cc, flags, [DRIVER, *isa.sources(str(build.CSRC))], exe)
        assert error is None, f"{cc} could not build the {name} driver:\n{error[-3000:]}"
        run = [exe] if native else [QEMU, "-L", CROSS_SYSROOT, exe]
        built[name] = run
        return run

    return get


def run_driver(cmd, tmp_path, cases, tag="cases"):
    src, dst = tmp_path / f"{tag}.bin", tmp_path / f"{tag}.out"
    write_cases(src, cases)
    proc = subprocess.run([*cmd, str(src), str(dst)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_arrays(dst, [c[3] for c in cases])


# ---- the cases and their torch references -------------------------------------------------------
def rand(gen, *shape, dt=F32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(TORCH_DTYPE[dt])


def small_ints(gen, *shape, dt=F32):
    return torch.randint(-3, 4, shape, generator=gen).float().to(TORCH_DTYPE[dt])


def product_cases(gen):
    """(case, check) pairs for the products: check(outputs) asserts against torch."""
    out = []
    for dt in (F32, BF16):
        for m in (1, 2, 5):
            x, w, b = rand(gen, m, 70, dt=dt), rand(gen, 37, 70, dt=dt), rand(gen, 37, dt=dt)
            y = torch.zeros(m, 37, dtype=TORCH_DTYPE[dt])
            want = F.linear(x.double(), w.double(), b.double())
            out.append((("linear", [m, 37, 70, dt, 2], [], [x, w, b, y]),
                        lambda a, want=want, dt=dt: torch.testing.assert_close(a[3].double(), want, **TOL[dt])))
        x, w = small_ints(gen, 3, 64, dt=dt), small_ints(gen, 40, 64, dt=dt)  # exact in any order
        want = (x.double() @ w.double().T).to(TORCH_DTYPE[dt])
        out.append((("linear", [3, 40, 64, dt, 2], [], [x, w, None, torch.zeros(3, 40, dtype=TORCH_DTYPE[dt])]),
                    lambda a, want=want: torch.testing.assert_close(a[3], want, atol=0, rtol=0)))
        for m, n, k in ((7, 70, 34), (13, 33, 64), (130, 20, 16)):
            x, w, b = rand(gen, m, k, dt=dt), rand(gen, n, k, dt=dt), rand(gen, n, dt=dt)
            want = F.linear(x.double(), w.double(), b.double())
            out.append((("gemm", [m, n, k, 0, dt, 2], [], [x, w, b, torch.zeros(m, n, dtype=TORCH_DTYPE[dt])]),
                        lambda a, want=want, dt=dt: torch.testing.assert_close(a[3].double(), want, **TOL[dt])))
        inter = 24
        x, w = rand(gen, 5, 40, dt=dt), rand(gen, 2 * inter, 40, dt=dt)
        gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)
        want = F.silu(gate) * up
        out.append((("gemm", [5, 2 * inter, 40, 1, dt, 2], [], [x, w, None, torch.zeros(5, inter, dtype=TORCH_DTYPE[dt])]),
                    lambda a, want=want, dt=dt: torch.testing.assert_close(a[3].double(), want, **TOL[dt])))
        x, w = small_ints(gen, 6, 16, dt=dt), small_ints(gen, 300, 16, dt=dt)
        want = (x.double() @ w.double().T).argmax(-1)  # exact sums: the first maximum, as torch
        out.append((("gemm_argmax", [6, 300, 16, 0, dt, 2], [], [x, w, None, torch.full((6,), -7, dtype=torch.int64)]),
                    lambda a, want=want: torch.testing.assert_close(a[3], want)))
        for m in (1, 2):
            x, w = rand(gen, m, 64, dt=dt), rand(gen, 500, 64, dt=dt, scale=0.05)
            w[123] = (x[0].float() * 0.5).to(w.dtype)  # one clear winner for every x row
            want = (x.double() @ w.double().T).argmax(-1)
            out.append((("linear_argmax_q8", [m, 500, 64, dt, 2], [], [x, w, torch.full((m,), -7, dtype=torch.int64)]),
                        lambda a, want=want: torch.testing.assert_close(a[2], want)))
        for t, experts, top_k, hidden, inter in ((1, 8, 2, 40, 24), (5, 6, 3, 33, 20)):
            x = rand(gen, t, hidden, dt=dt)
            w13 = rand(gen, experts, 2 * inter, hidden, dt=dt, scale=0.2)
            w2 = rand(gen, experts, hidden, inter, dt=dt, scale=0.2)
            weights, ids = torch.rand(t, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
            want = reference_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
            out.append((("moe", [t, top_k, experts, hidden, inter, dt, 2], [],
                         [x, w13, w2, ids, weights, torch.zeros(t, hidden, dtype=TORCH_DTYPE[dt])]),
                        lambda a, want=want, dt=dt: torch.testing.assert_close(
                            a[5].double(), want, **(TOL[dt] if dt == F32 else dict(atol=5e-2, rtol=5e-2)))))
    return out


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as omni_qlinear's int8-activation path rounds it (blocks of 32, d = max |x| / 127)."""
    v = x.float().reshape(x.shape[0], -1, 32)
    d = v.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    return (torch.round(v * torch.where(d > 0, 1.0 / d, torch.zeros_like(d))) * d).reshape(x.shape)


QUANT_KINDS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "int8", "Q4_1", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS", "Q2_K",
               "Q3_K", "fp8")


def quantized(gen, kind, rows, cols, scale=0.05):
    """A random rows x cols weight (normal, times `scale`) as `kind` stores it: (blocks, scale or
    None, the reference's dequantised weight)."""
    import numpy as np

    from omniinfer.quantization.base import dequantize_piece
    from omniinfer.quantization.int8 import quantize

    gguf = pytest.importorskip("gguf")
    from omniinfer.testing import kquant

    w = torch.randn(rows, cols, generator=gen) * scale
    if kind == "int8":
        piece = quantize(w)
        return piece.tensors["q"], piece.tensors["scale"], dequantize_piece(piece)
    if kind == "fp8":  # (e4m3 rows with a scale a 128 x 128 block, as FP8 checkpoints hold them)
        from omniinfer.quantization.fp8 import piece_of
        from omniinfer.testing.quant_weights import fp8_tensors
        from omniinfer_cpu.quant import spread_scales

        tensors, _ = fp8_tensors(w, (128, 128))
        piece = piece_of(tensors["weight"], tensors["weight_scale_inv"], (128, 128))
        return (piece.tensors["q"], spread_scales(piece.tensors["scale"], 128, cols),
                dequantize_piece(piece))
    q = kquant.QUANTIZERS[kind](w.numpy()) if kind in kquant.QUANTIZERS else \
        gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    blocks = torch.from_numpy(np.ascontiguousarray(q.view(np.uint8).reshape(rows, -1)))
    ref = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType[kind]).reshape(rows, cols))
    return blocks, None, ref


def quant_cases(gen):
    """omni_qlinear on each native format against the reference's dequantised weight, with float
    and with int8 activations."""
    from omniinfer_cpu.quant import F8_CODE, KIND_CODES, QACT_INT8, X8_CODES
    from omniinfer_cpu.quant_x8 import repack

    out = []
    for kind in QUANT_KINDS:
        code = F8_CODE if kind == "fp8" else KIND_CODES.get(kind if kind == "int8" else f"gguf:{kind}")  # (None: groups of 8 only)
        blocks, scale, ref = quantized(gen, kind, 19, 512)
        for dt, m in ((F32, 3), (BF16, 3), (F32, 20), (BF16, 20)):  # (20 rows: the decoded panels)
            x = rand(gen, m, 512, dt=dt)
            want = F.linear(x.double(), ref.double())
            if code is not None:
                out.append((("qlinear", [m, 19, 512, code, dt, 2], [], [x, blocks, scale,
                                                                         torch.zeros(m, 19, dtype=TORCH_DTYPE[dt])]),
                            lambda a, want=want, dt=dt: torch.testing.assert_close(a[3].double(), want, **TOL[dt])))
            # the int8-activation path (kind | QACT_INT8; up to 8 rows, int8 rows up to 96, beyond: the float panels) against
            # x rounded as it rounds it; the GGUF kinds also as their rows repacked in groups of 8 (the
            # only int8 path Q4_1 / Q5_0 / Q5_1 / Q5_K have)
            rounded = F.linear(int8_blocks(x).double(), ref.double())
            x8 = X8_CODES.get(f"gguf:{kind}")
            rows_as_stored = [(code, blocks)] if code is not None and code <= KIND_CODES["int8"] else []
            for c, w in rows_as_stored + ([(x8, repack(f"gguf:{kind}", blocks, (19, 512)).tensors["blocks8"])]
                                          if x8 else []):
                want = rounded if m <= 8 or c == x8 or kind == "int8" else want  # (the X8 groups: int8 at any row count)
                out.append((("qlinear", [m, 19, 512, c | QACT_INT8, dt, 2], [], [x, w, scale,
                                                                          torch.zeros(m, 19, dtype=TORCH_DTYPE[dt])]),
                            lambda a, want=want, dt=dt: torch.testing.assert_close(a[3].double(), want, **TOL[dt])))
    return out


PREFETCH_AHEAD = 4096  # csrc/prefetch.h: how far ahead of its loop a product prefetches


def prefetch_cases(gen, coded=()):
    """Batch-1 products (one x row) on every weight a decode streams, with their weight's
    prefetched lines marked (the driver's "prefetched_" cases): omni_qlinear on each kind's rows as
    stored (float and int8 activations) and in groups of 8, omni_linear on float32 and bfloat16, and
    omni_linear_ec on the coded copies of the dtypes in `coded` (those the driver's level decodes,
    packed by the kernels loaded here); each into L1 and into L2. Each weight is 64 x 2048, many
    times PREFETCH_AHEAD. (case, what it is, the bytes streamed: a coded copy's rows) triples."""
    from omniinfer_cpu.kernels import build
    from omniinfer_cpu.linear import EC_BITS
    from omniinfer_cpu.quant import F8_CODE, KIND_CODES, QACT_INT8, X8_CODES
    from omniinfer_cpu.quant_x8 import repack

    rows, cols = 64, 2048
    ways = []  # (what, kernel, kind code or dtype, weight, scale, x's dtype, bytes streamed)
    for kind in QUANT_KINDS:
        code = F8_CODE if kind == "fp8" else KIND_CODES.get(kind if kind == "int8" else f"gguf:{kind}")
        blocks, scale, _ = quantized(gen, kind, rows, cols)
        x8 = X8_CODES.get(f"gguf:{kind}")
        grouped = [] if x8 is None else [(f"{kind} groups of 8, int8 x", x8 | QACT_INT8,
                                          repack(f"gguf:{kind}", blocks, (rows, cols)).tensors["blocks8"], None)]
        as_stored = [] if code is None else [(f"{kind} rows, float x", code, blocks, scale)] + (
            [(f"{kind} rows, int8 x", code | QACT_INT8, blocks, scale)] if code <= KIND_CODES["int8"] else [])
        for what, c, w, sc in as_stored + grouped:
            ways.append((what, "qlinear", c, w, sc, F32, w.numel()))
    kernels = build.load()
    for dt in (F32, BF16):
        w = rand(gen, rows, cols, dt=dt, scale=0.05)
        ways.append((f"{TORCH_DTYPE[dt]} rows", "linear", dt, w, None, dt, w.numel() * w.element_size()))
        if dt in coded and kernels is not None and kernels.ec_supported(dt):
            patches = kernels.ec_count(w.data_ptr(), rows, cols, dt, 1)
            copy = torch.empty(kernels.ec_size(rows, cols, dt, patches), dtype=torch.uint8)
            assert patches >= 0 and kernels.ec_pack(w.data_ptr(), rows, cols, dt, patches, copy.data_ptr(), 1) == 0
            ways.append((f"{TORCH_DTYPE[dt]} coded rows", "linear_ec", dt, copy, None, dt,
                         rows * cols * EC_BITS[TORCH_DTYPE[dt]] // 8))
    out = []
    for what, kernel, code, w, scale, xdt, streamed in ways:
        x, y = rand(gen, 1, cols, dt=xdt), torch.zeros(1, rows, dtype=TORCH_DTYPE[xdt])
        seen = torch.zeros(-(-w.numel() * w.element_size() // 64), dtype=torch.uint8)
        for l2 in (0, 1):
            # qlinear: M N K kind dt threads; linear(_ec): M N K dt threads; then the driver's L2 flag
            ints = [1, rows, cols, code, xdt, 2, l2] if kernel == "qlinear" else [1, rows, cols, code, 2, l2]
            out.append(((f"prefetched_{kernel}", ints, [], [x, w, scale, y, seen]), f"{what}, into L{1 + l2}",
                        streamed))
    return out


def qmoe_cases(gen):
    """omni_qmoe (one token: int8 activations on groups of 8, float ones on rows as stored) and
    omni_qmoe_tokens (a chunk) against torch on the `gguf` package's dequantisation: the routed
    experts' weighted sum, x and the SiLU-and-multiply rounded as the int8 path rounds them."""
    from omniinfer_cpu.quant import KIND_CODES, QACT_INT8, X8_CODES
    from omniinfer_cpu.quant_x8 import repack

    E, H, inter = 5, 256, 256

    def expert(kind, rows, cols, grouped):
        blocks, _, ref = quantized(gen, kind, rows, cols, scale=0.1)
        return (repack(f"gguf:{kind}", blocks, (rows, cols)).tensors["blocks8"] if grouped else blocks), ref.double()

    out = []
    for kinds, tokens, int8 in ((("Q4_K", "Q6_K"), 1, True), (("Q8_0", "Q4_0"), 1, False),
                                (("Q4_0", "Q8_0"), 7, True)):
        codes = [(X8_CODES[f"gguf:{k}"] | QACT_INT8) if int8 else KIND_CODES[f"gguf:{k}"] for k in kinds]
        w13 = [expert(kinds[0], 2 * inter, H, int8) for _ in range(E)]
        w2 = [expert(kinds[1], H, inter, int8) for _ in range(E)]
        x = torch.randn(tokens, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(tokens)])
        weights = torch.rand(tokens, 3, generator=gen)
        act = int8_blocks if int8 else (lambda v: v)
        want = torch.zeros(tokens, H, dtype=torch.float64)
        for t in range(tokens):
            for e, w in zip(ids[t].tolist(), weights[t].tolist()):
                gate, up = F.linear(act(x[t:t + 1]).double(), w13[e][1]).chunk(2, dim=-1)
                want[t] += w * F.linear(act((F.silu(gate) * up).float()).double(), w2[e][1])[0]
        ints = [tokens, 3, E, H, inter, *codes, w13[0][0].numel(), w2[0][0].numel(), 2]
        arrays = [x, torch.cat([b for b, _ in w13]), torch.cat([b for b, _ in w2]), ids, weights, torch.zeros(tokens, H)]
        out.append((("qmoe", ints, [], arrays), lambda a, want=want: torch.testing.assert_close(
            a[5].double(), want, **TOL[F32])))
    return out


def layer_op_cases(gen):
    from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS as ops

    out = []
    for dt in (F32, BF16):
        x, r, w = rand(gen, 5, 200, dt=dt), rand(gen, 5, 200, dt=dt), rand(gen, 200, dt=dt)
        want, want_res = ops.rms_norm(x, w, 1e-6, r)
        res_out, normed = torch.zeros_like(x), torch.zeros_like(x)
        out.append((("rms_norm", [5, 200, dt, 2], [1e-6], [x, r, res_out, w, normed]),
                    lambda a, want=want, want_res=want_res, dt=dt: (
                        torch.testing.assert_close(a[4].float(), want.float(), **TOL[dt]),
                        torch.testing.assert_close(a[2].float(), want_res.float(), **TOL[dt]))))
        heads, kv_heads, d, t, max_pos = 4, 2, 64, 6, 64
        for rot in (d, 40):  # (the whole head; a partial rotary: a vector and a scalar tail on NEON)
            q, k = rand(gen, t, heads * d, dt=dt), rand(gen, t, kv_heads * d, dt=dt)
            pos = torch.tensor([0, 3, 7, 63, 1, 20], dtype=torch.int64)
            inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
            freqs = torch.arange(max_pos).float()[:, None] * inv[None]
            cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
            want_q, want_k = ops.rotary(pos, q.clone(), k.clone(), cos, sin, d)
            out.append((("rotary", [t, heads, kv_heads, d, dt, 2, max_pos, rot], [], [q, k, pos, cos, sin]),
                        lambda a, wq=want_q, wk=want_k, dt=dt: (
                            torch.testing.assert_close(a[0].float(), wq.float(), **TOL[dt]),
                            torch.testing.assert_close(a[1].float(), wk.float(), **TOL[dt]))))
        x = rand(gen, 3, 2 * 37, dt=dt)
        want = ops.silu_and_mul(x)
        out.append((("silu_and_mul", [3, 37, dt, 2], [], [x, torch.zeros(3, 37, dtype=TORCH_DTYPE[dt])]),
                    lambda a, want=want, dt=dt: torch.testing.assert_close(a[1].float(), want.float(), **TOL[dt])))
        x = rand(gen, 3, 1000, dt=dt)
        want = x.float().argmax(-1)
        out.append((("argmax", [3, 1000, dt, 2], [], [x, torch.full((3,), -7, dtype=torch.int64)]),
                    lambda a, want=want: torch.testing.assert_close(a[1], want)))
    return out


def attention_phases(gen, dt, block_size, lens=(5, 17, 1, 40), heads=4, kv_heads=2, d=32, window=0):
    """The prefill of every sequence's tokens but its last, then the decode of the last one over
    the cache the prefill wrote; and torch's causal attention over the whole sequences."""
    torch_dt = TORCH_DTYPE[dt]
    per_seq = -(-max(lens) // block_size)
    num_blocks = per_seq * len(lens) + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).reshape(len(lens), per_seq).int()
    seqs = [(rand(gen, n, heads, d, dt=dt), rand(gen, n, kv_heads, d, dt=dt), rand(gen, n, kv_heads, d, dt=dt))
            for n in lens]
    scale = d ** -0.5
    want = []
    for q, k, v in seqs:
        n, g = q.shape[0], heads // kv_heads
        kk, vv = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
        allowed = torch.ones(n, n).tril().bool()
        if window:
            allowed &= ~torch.ones(n, n).tril(-window).bool()
        s = s.masked_fill(~allowed, float("-inf"))
        want.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))

    def case(first: bool, caches):
        rows = [(range(0, n - 1) if first else range(n - 1, n)) for n in lens]
        q = torch.cat([s[0][list(r)] for s, r in zip(seqs, rows)]).reshape(-1, heads * d)
        key = torch.cat([s[1][list(r)] for s, r in zip(seqs, rows)]).reshape(-1, kv_heads * d)
        value = torch.cat([s[2][list(r)] for s, r in zip(seqs, rows)]).reshape(-1, kv_heads * d)
        slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                              for i, r in enumerate(rows) for p in r], dtype=torch.int64)
        counts = [len(r) for r in rows]
        qsl = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
        seq_lens = torch.tensor([r.stop for r in rows], dtype=torch.int32)
        k_cache, v_cache = caches
        ints = [q.shape[0], len(lens), heads, kv_heads, d, block_size, window, dt, 2, per_seq]
        arrays = [q, key, value, slots, k_cache, v_cache, tables.contiguous(), qsl, seq_lens,
                  torch.zeros(q.shape[0], heads * d, dtype=torch_dt)]
        return ("paged_attention", ints, [scale], arrays), rows

    fresh = tuple(torch.zeros(num_blocks, kv_heads, block_size, d, dtype=torch_dt) for _ in range(2))
    return case, fresh, want


# ---- the tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("target", _driver_targets())
def test_kernels_without_python(target, drivers, tmp_path):
    cmd = drivers(target)
    assert subprocess.run([*cmd, "--isa"], capture_output=True, text=True, timeout=60).stdout.strip() == target
    gen = torch.Generator().manual_seed(7)
    checks = product_cases(gen) + layer_op_cases(gen) + quant_cases(gen) + qmoe_cases(gen)
    outs = run_driver(cmd, tmp_path, [c for c, _ in checks])
    for (case, check), arrays in zip(checks, outs):
        try:
            check(arrays)
        except AssertionError as e:
            raise AssertionError(f"{target}: {case[0]} {case[1]}: {e}") from None
    for dt in (F32, BF16):
        for block_size, window in ((16, 0), (2, 0), (16, 9)):
            make, caches, want = attention_phases(gen, dt, block_size, window=window)
            prefill, rows = make(True, caches)
            (first,) = run_driver(cmd, tmp_path, [prefill], "prefill")
            decode, last_rows = make(False, (first[4], first[5]))  # the caches the prefill wrote
            (second,) = run_driver(cmd, tmp_path, [decode], "decode")
            for out, phase_rows in ((first[9], rows), (second[9], last_rows)):
                got = out
                at = 0
                for ref, r in zip(want, phase_rows):
                    n = len(r)
                    expect = ref[list(r)].flatten(1)
                    where = f"{target} attention dt={dt} block_size={block_size} window={window}"
                    torch.testing.assert_close(got[at:at + n].double(), expect, **TOL[dt],
                                               msg=lambda m, where=where: f"{where}: {m}")
                    at += n


@pytest.mark.parametrize("target", _driver_targets())
def test_batch1_products_prefetch_every_line_of_their_weight(target, drivers, tmp_path):
    """A batch-1 product prefetches each line of the weight it streams (csrc/prefetch.h), past the
    first PREFETCH_AHEAD bytes, into L1 and into L2 alike: a line it skips is a demand miss from
    memory where prefetcht1 leaves the L1 to the hardware. The K-quant groups of 8 once skipped
    each block's 128-144-byte header; on a Zen 4 with prefetcht1 that left Q4_K, Q5_K and Q6_K
    streams 1.2-1.6x slower (docs/performance.md, twelfth pass)."""
    cmd = drivers(target)
    decoded = subprocess.run([*cmd, "--coded"], capture_output=True, text=True, timeout=60).stdout.split()
    coded = [dt for dt, on in zip((F32, BF16), decoded) if on == "1"]
    gen = torch.Generator().manual_seed(7)
    cases = prefetch_cases(gen, coded)
    outs = run_driver(cmd, tmp_path, [c for c, _, _ in cases], "prefetch")
    missed = []
    for (_, what, streamed), arrays in zip(cases, outs):
        seen = arrays[-1][:-(-streamed // 64)]
        lines = torch.nonzero(seen[PREFETCH_AHEAD // 64:] == 0).flatten() + PREFETCH_AHEAD // 64
        if len(lines):
            missed.append(f"{what}: {len(lines)} of {len(seen)} lines never prefetched, at bytes "
                          f"{(lines[:6] * 64).tolist()} of {streamed}")
    assert not missed, f"{target}:\n" + "\n".join(missed)
