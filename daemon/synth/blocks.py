"""Random quantized blocks, written directly: random codes with fixed, sane scales.

Quantizing random floats would cost far more than writing the file; instead each block's code
bytes are random (uniform) and its scale fields are set so that the weights it decodes to have
mean ~0 and the requested standard deviation `std`:

    Q8_0   [d f16][32 x int8]                   w = d * q, q uniform in -128..127 (rms 73.9)
    Q4_K   [d f16][dmin f16][12 scales][128 qs]  every sub-block scale = min = 8 (6-bit),
                                                w = d*8*q - dmin*8 with q in 0..15, dmin = 7.5 d
    Q5_K   [d][dmin][12 scales][32 qh][128 qs]   the same with q in 0..31, dmin = 15.5 d
    Q6_K   [128 ql][64 qh][16 x int8 scales][d]  every scale +-8 (random sign: q-32 has mean -1/2,
                                                which a common sign would add to every row alike),
                                                w = d*scale*(q-32), q in 0..63
    MXFP4  [e8m0][16 qs]                        w = e2m1(q) * 2^(e-128), doubled e2m1 rms 5.85

`random_blocks(type, n_blocks, std, rng)` returns the bytes of n_blocks such blocks (uint8, one row
per block). The random bytes come from the bit generator's raw output (PCG64DXSM via
`random_raw`), several times faster than `Generator.bytes`.
"""

from __future__ import annotations

import numpy as np

from .presets import BLOCK

SUB_SCALE = 8  # K-quant sub-block scale code: small, so d stays a normal f16 for small std
_UNIFORM_RMS = {  # rms of the integer code each type multiplies by its scale
    "Q8_0": float(np.sqrt((np.arange(-128, 128) ** 2).mean())),
    "Q4_K": float(np.arange(16).std()), "Q5_K": float(np.arange(32).std()),
    "Q6_K": float(np.sqrt(((np.arange(64) - 32.0) ** 2).mean())),
    "MXFP4": float(np.sqrt((np.array([0, 1, 2, 3, 4, 6, 8, 12], dtype=np.float64) ** 2).mean())),
}
_K4_SCALES = bytes([SUB_SCALE] * 8 + [(SUB_SCALE & 15) | ((SUB_SCALE & 15) << 4)] * 4)  # sc = m = 8


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def fixed_fields(qtype: str, std: float) -> list[tuple[int, bytes]]:
    """(offset, bytes) of the scale fields of one `qtype` block for weights of deviation `std`."""
    d = std / (_UNIFORM_RMS[qtype] * (1 if qtype in ("Q8_0", "MXFP4") else SUB_SCALE))
    if qtype == "Q8_0":
        return [(0, _f16(d))]
    if qtype in ("Q4_K", "Q5_K"):
        mid = 7.5 if qtype == "Q4_K" else 15.5  # dmin * 8 = d * 8 * mean(q): centred
        return [(0, _f16(d) + _f16(d * mid)), (4, _K4_SCALES)]
    if qtype == "Q6_K":
        return [(192, bytes([SUB_SCALE] * 16)), (208, _f16(d))]
    if qtype == "MXFP4":
        return [(0, bytes([int(np.clip(128 + np.rint(np.log2(d)), 1, 254))]))]
    raise ValueError(f"no random blocks for {qtype}")


def random_blocks(qtype: str, n_blocks: int, std: float, bitgen: np.random.BitGenerator) -> np.ndarray:
    """`n_blocks` random `qtype` blocks as uint8 [n_blocks, block bytes]."""
    size = BLOCK[qtype][1]
    n = n_blocks * size
    raw = bitgen.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(n_blocks, size)
    if qtype == "Q6_K":  # keep the random bytes' low bit as the sign of each scale
        sign = raw[:, 192:208] & 1
    for offset, field in fixed_fields(qtype, std):
        raw[:, offset:offset + len(field)] = np.frombuffer(field, dtype=np.uint8)
    if qtype == "Q6_K":
        raw[:, 192:208] = np.where(sign, np.uint8(256 - SUB_SCALE), np.uint8(SUB_SCALE))
    return raw
