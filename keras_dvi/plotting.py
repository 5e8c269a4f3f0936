"""A dependency-free PNG plot of a 1-D predictive (used by the main job).

keras-dvi does not depend on matplotlib; this draws points, a mean curve and a shaded
interval band on a white canvas with NumPy and writes it with the standard library.
"""

import struct
import zlib

import numpy as np

_BAND = (198, 219, 239)
_MEAN = (8, 81, 156)
_POINTS = (90, 90, 90)
_AXES = (0, 0, 0)


def _png_bytes(image):
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(height))

    def chunk(tag, data):
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_band_plot(path, x, mean, half_width, x_points, y_points, size=(480, 720), margin=30):
    """Writes a PNG: `mean +- half_width` over sorted `x` as a band and line, and the points."""
    height, width = size
    order = np.argsort(x)
    x, mean, half_width = x[order], mean[order], half_width[order]
    lower, upper = mean - half_width, mean + half_width
    y_all = np.concatenate([lower, upper, y_points])
    y_lo, y_hi = float(y_all.min()), float(y_all.max())
    x_lo, x_hi = float(min(x.min(), x_points.min())), float(max(x.max(), x_points.max()))

    def col(v):
        return np.clip(margin + (v - x_lo) / (x_hi - x_lo or 1.0) * (width - 2 * margin), 0, width - 1).astype(int)

    def row(v):
        return np.clip(height - margin - (v - y_lo) / (y_hi - y_lo or 1.0) * (height - 2 * margin), 0, height - 1).astype(int)

    image = np.full((height, width, 3), 255, dtype=np.uint8)
    columns = np.arange(width)
    xs = x_lo + (columns - margin) / (width - 2 * margin) * (x_hi - x_lo)
    inside = (xs >= x.min()) & (xs <= x.max())
    lo_rows, hi_rows = row(np.interp(xs, x, lower)), row(np.interp(xs, x, upper))
    rows = np.arange(height)[:, None]
    band = (rows <= lo_rows[None]) & (rows >= hi_rows[None]) & inside[None]
    image[band] = _BAND
    mean_rows = row(np.interp(xs, x, mean))
    for offset in (-1, 0, 1):
        keep = inside
        image[np.clip(mean_rows[keep] + offset, 0, height - 1), columns[keep]] = _MEAN
    pr, pc = row(y_points), col(x_points)
    for dr in (-1, 0, 1):
        for dc in (-1, 0, 1):
            image[np.clip(pr + dr, 0, height - 1), np.clip(pc + dc, 0, width - 1)] = _POINTS
    image[height - margin, margin : width - margin] = _AXES
    image[margin : height - margin, margin] = _AXES
    with open(path, "wb") as f:
        f.write(_png_bytes(image))
