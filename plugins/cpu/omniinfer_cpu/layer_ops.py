"""The CPU plugin's layer ops: RMS norm (+ residual add), rotary embedding and SiLU-and-multiply
as single compiled passes (``omni_rms_norm``, ``omni_rotary``, ``omni_silu_and_mul``) instead of
5-14 torch ops each, and the greedy argmax straight from bfloat16 or float32 logits
(``omni_argmax``: no float32 copy, one pass); anything the kernels do not cover goes to the
torch versions."""

from __future__ import annotations

import torch

from omniinfer.models.layers.layer_ops import LayerOps

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class CpuLayerOps(LayerOps):
    def __init__(self, kernels):
        self.k = kernels

    def rms_norm(self, x, weight, eps, residual=None):
        dt = DTYPE_CODES.get(x.dtype)
        if (dt is None or x.dim() != 2 or weight.dtype != x.dtype or not x.is_contiguous()
                or (residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()))):
            return super().rms_norm(x, weight, eps, residual)
        out = torch.empty_like(x)
        new_residual = None if residual is None else torch.empty_like(x)
        self.k.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                        None if residual is None else new_residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), x.shape[0], x.shape[1], eps, dt, torch.get_num_threads())
        return out if residual is None else (out, new_residual)

    def rotary(self, positions, query, key, cos, sin, head_size):
        dt = DTYPE_CODES.get(query.dtype)
        if (dt is None or key.dtype != query.dtype or query.stride(-1) != 1 or key.stride(-1) != 1
                or cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()
                or not 0 < 2 * cos.shape[1] <= head_size):
            return super().rotary(positions, query, key, cos, sin, head_size)
        result = self.k.rotary(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
                               positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                               query.shape[0], query.shape[1] // head_size, key.shape[1] // head_size,
                               head_size, 2 * cos.shape[1], dt, torch.get_num_threads())
        if result != 0:
            raise IndexError(f"a position is outside the rotary table ({cos.shape[0]} positions)")
        return query, key

    def silu_and_mul(self, x):
        dt = DTYPE_CODES.get(x.dtype)
        if dt is None or x.dim() != 2 or not x.is_contiguous() or x.shape[1] % 2:
            return super().silu_and_mul(x)
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        self.k.silu_and_mul(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2, dt,
                            torch.get_num_threads())
        return out

    def argmax_rows(self, logits):
        dt = DTYPE_CODES.get(logits.dtype)
        if (dt is None or logits.dim() != 2 or logits.device.type != "cpu" or logits.stride(1) != 1
                or logits.shape[1] == 0):
            return super().argmax_rows(logits)
        rows = logits.shape[0]
        out = torch.empty(rows, dtype=torch.int64)
        self.k.argmax(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], dt, out.data_ptr(),
                      torch.get_num_threads())
        return out
