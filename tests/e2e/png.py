"""A minimal PNG reader (8-bit RGB/RGBA/grey, not interlaced) with zlib and numpy: no Pillow needed."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # colour type -> channels


def _unfilter_row(kind: int, cur: bytearray, prev: bytes, bpp: int) -> None:
    n = len(cur)
    if kind == 0:
        return
    if kind == 1:  # Sub
        for i in range(bpp, n):
            cur[i] = (cur[i] + cur[i - bpp]) & 0xFF
    elif kind == 2:  # Up
        for i in range(n):
            cur[i] = (cur[i] + prev[i]) & 0xFF
    elif kind == 3:  # Average
        for i in range(n):
            left = cur[i - bpp] if i >= bpp else 0
            cur[i] = (cur[i] + ((left + prev[i]) >> 1)) & 0xFF
    elif kind == 4:  # Paeth
        for i in range(n):
            a = cur[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            cur[i] = (cur[i] + pred) & 0xFF
    else:
        raise ValueError(f"bad PNG filter type {kind}")


def read_png(path: str | Path) -> np.ndarray:
    """The image as a uint8 array ``[height, width, channels]``."""
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat = 8, bytearray()
    width = height = depth = colour = interlace = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    if depth != 8 or interlace or colour not in CHANNELS:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = CHANNELS[colour]
    stride = width * bpp
    raw = zlib.decompress(bytes(idat))
    out = np.empty((height, stride), dtype=np.uint8)
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind = raw[start]
        row = raw[start + 1 : start + 1 + stride]
        if kind == 2:  # Up: vectorised
            cur_arr = (np.frombuffer(row, np.uint8).astype(np.uint16) + np.frombuffer(prev, np.uint8)) & 0xFF
            out[y] = cur_arr
        else:
            cur = bytearray(row)
            _unfilter_row(kind, cur, prev, bpp)
            out[y] = np.frombuffer(bytes(cur), np.uint8)
        prev = out[y].tobytes()
    return out.reshape(height, width, bpp)
