"""Reader of the npz files of the ``shared/data`` layout (``shared/data/MANIFEST.md``): one
archive per split (or one per set, split here), fields ``x`` (uint8 images) and ``y`` (int64
labels)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from edge_agent.data._records import DatasetInfo, validate_raw
from edge_agent.errors import DataError


def read_npz(path: Path, info: DatasetInfo) -> tuple[np.ndarray, np.ndarray]:
    """Read and validate ``x`` and ``y`` of one MANIFEST-style npz file."""
    where = str(path)
    arrays: dict[str, np.ndarray] = {}
    # Open the file here (not by path in np.load) so it is closed even when the archive is
    # corrupt: np.load leaks its own handle when zipfile rejects the bytes.
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed by the with-block below
    except OSError as exc:
        raise DataError(
            f"{where}: cannot be opened ({exc})", dataset=info.name, path=where
        ) from exc
    with handle:
        try:
            archive = np.load(handle, allow_pickle=False)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise DataError(
                f"{where}: cannot be read as an npz archive ({type(exc).__name__}: {exc})",
                dataset=info.name,
                path=where,
            ) from exc
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise DataError(
                f"{where}: is a single .npy array, expected an npz archive with fields 'x' "
                "and 'y'",
                dataset=info.name,
                path=where,
            )
        with archive:
            for field in ("x", "y"):
                if field not in archive.files:
                    raise DataError(
                        f"{where}: field {field!r} is missing (fields present: "
                        f"{sorted(archive.files)})",
                        dataset=info.name,
                        path=where,
                        field=field,
                    )
                try:
                    arrays[field] = archive[field]
                except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
                    raise DataError(
                        f"{where}: field {field!r} cannot be read ({type(exc).__name__}: {exc})",
                        dataset=info.name,
                        path=where,
                        field=field,
                    ) from exc
    validate_raw(arrays["x"], arrays["y"], info, where)
    return arrays["x"], arrays["y"]
