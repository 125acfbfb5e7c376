"""The byte layout of llama.cpp's K-quant blocks (ggml-common.h: block_q2_K, block_q3_K, block_q4_K, block_q6_K),
written from a K-quant student's own codes (quantizer.KQuantizer.gguf_fields), integer sub-block scales / mins and fp16 super-block scales, so that
gguf's dequantiser returns the student's Wq bit for bit (writer.py writes the file).

Per 256-weight super-block, in file order (bit j of a byte: `>> j`):
    Q2_K (84 B):  scales[16] (sc low nibble, m high) | qs[64] | d | dmin
    Q3_K (110 B): hmask[32] | qs[64] | scales[12] (6-bit sc + 32) | d
    Q4_K (144 B): d | dmin | scales[12] (6-bit sc and m) | qs[128]
    Q6_K (210 B): ql[128] | qh[64] | scales[16] (int8) | d
2-bit fields: weight h * 128 + j * 32 + l sits in byte h * 32 + l at bits 2j (Q2_K, Q3_K's low bits, Q6_K's high
bits); Q3_K's high bit of weight j * 32 + l is bit j of hmask[l]; nibbles pair weight l with weight l + 32 (Q4_K)
or l + 64 (Q6_K) of the same 64- or 128-weight run.
"""
from __future__ import annotations

import numpy as np

from qat_lora.quant.config import QK_K


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)  # [n, 2] little-endian


def _crumbs(u: np.ndarray) -> np.ndarray:
    """2-bit values [n, 256] -> [n, 64]: byte h * 32 + l holds weight h * 128 + j * 32 + l at bits 2j."""
    u = u.reshape(-1, 2, 4, 32).astype(np.uint8)
    return sum(u[:, :, j] << (2 * j) for j in range(4)).astype(np.uint8).reshape(-1, 64)


def _q2_k(q, sc, d, m, dmin):
    scales = (sc | (m << 4)).astype(np.uint8)
    return [scales, _crumbs(q), _fp16_bytes(d), _fp16_bytes(dmin)]


def _q3_k(q, sc, d, m, dmin):
    u = (q + 4).astype(np.uint8)  # q in [-4, 3]; gguf subtracts 4 where the high bit is 0
    high = (u >> 2).reshape(-1, 8, 32)
    hmask = sum(high[:, j] << j for j in range(8)).astype(np.uint8)
    s = (sc + 32).astype(np.uint8)  # [n, 16] in [0, 63]
    low = s & 0xF
    top = (s >> 4).reshape(-1, 4, 4)  # sub-block k * 4 + i -> byte 8 + i, bits 2k
    scales = np.concatenate([low[:, :8] | (low[:, 8:] << 4),
                             sum(top[:, k] << (2 * k) for k in range(4)).astype(np.uint8)], -1)
    return [hmask, _crumbs(u & 3), scales, _fp16_bytes(d)]


def _q4_k(q, sc, d, m, dmin):
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)  # [n, 8] each, 6 bits
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], -1)
    u = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(-1, 128)
    return [_fp16_bytes(d), _fp16_bytes(dmin), scales, qs]


def _q6_k(q, sc, d, m, dmin):
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # q in [-32, 31]
    ql = ((u[:, :, :64] & 0xF) | ((u[:, :, 64:] & 0xF) << 4)).reshape(-1, 128)
    qh = _crumbs(u >> 4)
    return [ql, qh, sc.astype(np.int8).view(np.uint8), _fp16_bytes(d)]


PACKERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q6_K": _q6_k}


def pack_kquant(qtype: str, q: np.ndarray, d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None = None,
                m: np.ndarray | None = None) -> np.ndarray:
    """Lay out K-quant super-blocks.

    Args:
        q: [rows, cols] signed codes (Q2_K [0, 3], Q3_K [-4, 3], Q4_K [0, 15], Q6_K [-32, 31]); cols % 256 == 0.
        d, dmin: [rows, cols / 256] (stored fp16); sc, m: [rows, cols / sub-block] integers.
    Returns:
        [rows, bytes per row] uint8, what GGUFWriter.add_tensor takes with raw_dtype set.
    """
    rows, cols = q.shape
    n = rows * cols // QK_K

    def flat(x):
        return None if x is None else np.asarray(x).reshape(n, -1)

    args = [flat(x) for x in (q, sc, d, m, dmin)]
    args = [a.astype(np.int16) if a is not None and i in (0, 1, 3) else a for i, a in enumerate(args)]
    parts = PACKERS[qtype](*args)
    return np.ascontiguousarray(np.concatenate(parts, -1).reshape(rows, -1))
