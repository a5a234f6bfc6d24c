"""Image conversions every data set goes through: to model input, resizing, grey to RGB.

Pure functions on numpy arrays (no I/O): :func:`normalize_images` (uint8 → float32 in [-1, 1],
HWC → CHW), :func:`resize_bilinear` with :func:`bilinear_weights` (PIL's bilinear rule), and
:func:`to_rgb`.
"""

from __future__ import annotations

import numpy as np

from edge_agent.data._records import describe_array
from edge_agent.errors import DataError

NORMALIZE_CHUNK = 4096
"""Images converted to float32 at a time (bounds the peak memory of a resize or a conversion)."""


def normalize_images(x: np.ndarray) -> np.ndarray:
    """Convert raw images to model input, the conversion every data set here goes through.

    Args:
        x: uint8 ``[N, H, W]`` (grayscale) or ``[N, H, W, 3]`` (RGB, HWC), values 0–255.

    Returns:
        float32 ``[N, 1, H, W]`` or ``[N, 3, H, W]`` (C-contiguous, writable, a new array) with
        values ``(x / 255 − 0.5) / 0.5`` in [-1, 1]; 0 → −1.0 and 255 → 1.0 exactly.

    Raises:
        DataError: ``x`` is not uint8, or not of one of the two shapes above (``field="x"``).
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise DataError(f"images must be uint8, got {describe_array(x)}", field="x")
    if x.ndim == 3:
        chw = x[:, None, :, :]
    elif x.ndim == 4 and x.shape[3] == 3:
        chw = x.transpose(0, 3, 1, 2)
    else:
        raise DataError(
            f"images must be [N, H, W] or [N, H, W, 3], got shape {x.shape}", field="x"
        )
    out = np.ascontiguousarray(chw).astype(np.float32)
    out /= np.float32(255.0)
    out -= np.float32(0.5)
    out /= np.float32(0.5)
    return out


def bilinear_weights(src: int, dst: int) -> np.ndarray:
    """The ``[dst, src]`` float64 matrix of 1-D bilinear (triangle-filter) resampling.

    Row i holds the weights of output pixel i: its centre maps to ``c = (i + 0.5) · src / dst``
    in input coordinates (pixel centres at ``j + 0.5``, as PIL and ``align_corners=False``);
    input pixel j gets ``max(0, 1 − |j + 0.5 − c| / r)`` with radius ``r = max(1, src / dst)``
    (widened when shrinking, as an antialiasing filter), for ``int(c − r + 0.5) <= j <
    int(c + r + 0.5)`` clipped to ``[0, src)``; the row is then divided by its sum. This is
    PIL's ``Image.resize(..., BILINEAR)`` coefficient rule
    (``ImagingResample``, ``precompute_coeffs``), without PIL's fixed-point rounding.

    Raises:
        DataError: ``src`` or ``dst`` < 1.
    """
    if src < 1 or dst < 1:
        raise DataError(f"bilinear_weights: sizes must be >= 1, got {src} -> {dst}")
    scale = src / dst
    radius = max(scale, 1.0)
    w = np.zeros((dst, src), dtype=np.float64)
    for i in range(dst):
        centre = (i + 0.5) * scale
        lo = max(int(centre - radius + 0.5), 0)
        hi = min(int(centre + radius + 0.5), src)
        j = np.arange(lo, hi)
        row = np.maximum(0.0, 1.0 - np.abs((j + 0.5 - centre) / radius))
        w[i, lo:hi] = row / row.sum()
    return w


def resize_bilinear(x: np.ndarray, size: int) -> np.ndarray:
    """Resize uint8 images to ``size``×``size`` by separable bilinear resampling.

    Args:
        x: uint8 ``[N, H, W]`` or ``[N, H, W, 3]`` (HWC).
        size: S, the output side in pixels (>= 1).

    Returns:
        uint8 ``[N, S, S]`` or ``[N, S, S, 3]``: ``rint(Wh · x · Wwᵀ)`` clipped to 0–255, with
        ``Wh = bilinear_weights(H, S)`` and ``Ww = bilinear_weights(W, S)`` (float32
        arithmetic); within one grey level of PIL ``Image.resize((S, S), BILINEAR)``, which
        rounds between its two passes. ``x`` itself (not a copy) when already S×S.

    Raises:
        DataError: ``x`` is not uint8 of one of the two shapes.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or not (
        x.ndim == 3 or (x.ndim == 4 and x.shape[3] == 3)
    ):
        raise DataError(f"resize_bilinear needs uint8 [N, H, W] or [N, H, W, 3], got "
                        f"{describe_array(x)}", field="x")
    h, w = x.shape[1], x.shape[2]
    if (h, w) == (size, size):
        return x
    wh = bilinear_weights(h, size).astype(np.float32)
    ww_t = bilinear_weights(w, size).T.astype(np.float32)
    planes = x if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # [N, H, W] or [N, 3, H, W]
    out = np.empty(planes.shape[:-2] + (size, size), dtype=np.uint8)
    for a in range(0, len(planes), NORMALIZE_CHUNK):
        v = np.matmul(np.matmul(wh, planes[a:a + NORMALIZE_CHUNK].astype(np.float32)), ww_t)
        out[a:a + NORMALIZE_CHUNK] = np.clip(np.rint(v), 0, 255).astype(np.uint8)
    return out if x.ndim == 3 else np.ascontiguousarray(out.transpose(0, 2, 3, 1))


def to_rgb(x: np.ndarray) -> np.ndarray:
    """Give uint8 images 3 channels: grey ``[N, H, W]`` is copied into R, G and B
    (``[N, H, W, 3]``, as torchvision ``Grayscale(num_output_channels=3)``); RGB
    ``[N, H, W, 3]`` is returned as is.

    Raises:
        DataError: ``x`` is not uint8 of one of the two shapes.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.uint8:
        raise DataError(f"to_rgb needs uint8 images, got {describe_array(x)}", field="x")
    if x.ndim == 4 and x.shape[3] == 3:
        return x
    if x.ndim == 3:
        return np.repeat(x[..., None], 3, axis=3)
    raise DataError(f"to_rgb needs [N, H, W] or [N, H, W, 3], got shape {x.shape}", field="x")
