"""Model manifests: a model's ``state_dict`` entries as ``(name, shape, dtype)`` and their 16-hex
fingerprint, so that an agent and the server can check, before exchanging tensors, that they hold
the same architecture."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from torch import nn

from edge_agent.errors import ModelError

__all__ = ["Manifest", "manifest_hash", "model_manifest"]

Manifest = list[tuple[str, tuple[int, ...], str]]
"""``[(state_dict name, shape, dtype name such as "float32"), ...]`` in state_dict order."""


def model_manifest(model: nn.Module) -> Manifest:
    """List a model's ``state_dict`` entries.

    Args:
        model: any ``torch.nn.Module``.

    Returns:
        ``[(name, shape, dtype), ...]`` in ``state_dict`` order; ``shape`` a tuple of Python
        ints, ``dtype`` the torch dtype name without the ``torch.`` prefix (``"float32"``).
        Buffers (e.g. BatchNorm running stats) are included, as they are in the state dict.
    """
    return [
        (name, tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for name, tensor in model.state_dict().items()
    ]


def manifest_hash(manifest: Sequence[tuple[str, Sequence[int], str]]) -> str:
    """Short fingerprint of a manifest.

    Canonical form: ``json.dumps([[name, [dims...], dtype], ...], separators=(",", ":"),
    ensure_ascii=True)`` encoded as UTF-8, in the manifest's order (order matters). The result
    is the **first 16 hex characters** (64 bits) of the SHA-256 of those bytes.

    Args:
        manifest: as returned by :func:`model_manifest`.

    Returns:
        16 lower-case hex characters.

    Raises:
        ModelError: an entry is not ``(str, sequence of int, str)``.
    """
    canonical: list[list[object]] = []
    for entry in manifest:
        try:
            name, shape, dtype = entry
            dims = [int(d) for d in shape]
        except (TypeError, ValueError) as exc:
            raise ModelError(
                f"bad manifest entry {entry!r}: expected (name, shape, dtype)"
            ) from exc
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise ModelError(f"bad manifest entry {entry!r}: name and dtype must be strings")
        canonical.append([name, dims, dtype])
    text = json.dumps(canonical, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
