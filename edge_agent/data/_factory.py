"""Reader of a data set added with :func:`edge_agent.data.register_dataset`: calls its factory and
checks what comes back against the factory contract written there."""

from __future__ import annotations

from pathlib import Path

from edge_agent.data._records import DatasetInfo, RawSplits, validate_raw
from edge_agent.errors import DataError


def factory_name(info: DatasetInfo) -> str:
    """``module.qualname`` of the factory of ``info`` (for messages and ``Dataset.source``)."""
    f = info.factory
    module = getattr(f, "__module__", None) or "?"
    return f"{module}.{getattr(f, '__qualname__', type(f).__name__)}"


def read_factory(info: DatasetInfo, data_dir: Path | None) -> RawSplits:
    """Call the factory of ``info`` with ``data_dir`` and validate its four arrays.

    Args:
        info: a registry entry whose ``factory`` is set.
        data_dir: the data folder of step 1 of the resolution order, or None.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: uint8 ``[N, S, S]`` or ``[N, S, S, 3]``, int64
        ``[N]``, as the factory returned them (validated against ``info``).

    Raises:
        DataError: the factory raised (a :class:`DataError` unchanged; anything else converted,
            the original as ``__cause__``), did not return four arrays, or an array does not
            match ``info`` (the message names the factory, the split and the field).
    """
    if info.factory is None:  # pragma: no cover - internal misuse
        raise DataError(f"internal error: data set {info.name!r} has no factory", dataset=info.name)
    who = f"data set {info.name!r}: factory {factory_name(info)}"
    try:
        out = info.factory(data_dir)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"{who} failed ({type(exc).__name__}: {exc})", dataset=info.name) from exc
    if not isinstance(out, tuple | list) or len(out) != 4:
        got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, tuple | list) else type(out).__name__
        raise DataError(f"{who} must return a tuple (x_train, y_train, x_test, y_test), got {got}",
                        dataset=info.name)
    x_tr, y_tr, x_te, y_te = out
    for x, y, split in ((x_tr, y_tr, "train"), (x_te, y_te, "test")):
        validate_raw(x, y, info, f"{who} ({split})")
    return x_tr, y_tr, x_te, y_te
