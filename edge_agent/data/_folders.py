"""Where a data set is looked for, in order, and when torchvision may download it.

The resolution order (steps 1–4) is written in the docstring of :mod:`edge_agent.data`;
:func:`locate` follows it and, when nothing is found, raises the :class:`DataError` that lists
every place searched and says which files to put where. ``_SHARED_DATA_DIRS`` and
``_TORCHVISION_CACHE`` are module attributes so that tests can point them elsewhere
(``monkeypatch.setattr(edge_agent.data._folders, "_SHARED_DATA_DIRS", ...)``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from edge_agent.data._download import download_torchvision
from edge_agent.data._records import DatasetInfo
from edge_agent.data._torchvision import TORCHVISION_MARKERS, layout_present
from edge_agent.errors import DataError

log = logging.getLogger(__name__)


ENV_DATA_DIR = "FEDFLEET_DATA"
"""Environment variable naming a data directory, used when ``data_dir`` is not given."""


ENV_OFFLINE = "FEDFLEET_OFFLINE"
"""Environment variable; ``"1"`` forbids torchvision downloads when ``allow_download`` is None."""

_REPO_DIR = Path(__file__).resolve().parents[2]
"""The folder holding the ``edge_agent`` package."""

# Step 2 of the resolution order; a module attribute so tests can point it elsewhere.
_SHARED_DATA_DIRS: tuple[Path, ...] = (
    (_REPO_DIR / ".." / "shared" / "data").resolve(),
    _REPO_DIR / "shared" / "data",
)
# Step 3: where torchvision layouts are looked for after the data folder, and downloads go.
_TORCHVISION_CACHE = Path("~/.cache/fedfleet/torchvision")


def locate(
    info: DatasetInfo, data_dir: str | os.PathLike[str] | None, allow_download: bool | None
) -> tuple[str, tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Find single-domain set ``info`` by the resolution order (downloading if allowed).

    Args:
        info: a single-domain registry entry.
        data_dir: the ``data_dir`` argument of :func:`~edge_agent.data.load_dataset`.
        allow_download: as there (None: allowed unless env ``FEDFLEET_OFFLINE`` is ``"1"``).

    Returns:
        ``(kind, location, stamps)``, what ``_read.read_raw`` reads and the cache key of a
        loaded set: kind ``"sklearn"`` (location ``()``), ``"factory"`` (location: the data
        folder of step 1, or ``()`` when none is set), ``"npz"`` (location: the resolved files;
        stamps: their ``(mtime_ns, size)``) or ``"torchvision"`` (location: the root).

    Raises:
        DataError: as :func:`~edge_agent.data.load_dataset`.
    """
    if info.sklearn:
        return "sklearn", (), ()

    if info.factory is not None:
        user_dir = user_data_dir(data_dir, then=f"the factory of {info.name!r} is given it all the same")
        return "factory", (str(user_dir),) if user_dir is not None else (), ()
    user_dir = user_data_dir(data_dir)
    npz_dirs = npz_search_dirs(user_dir)
    searched: list[str] = []
    for folder in npz_dirs:
        searched.append(str(folder))
        paths = [folder / rel for rel in info.files]
        if all(p.is_file() for p in paths):
            resolved = tuple(str(p.resolve()) for p in paths)
            stamps = tuple(_file_stamp(p) for p in paths)
            if user_dir is not None and folder != user_dir:
                _say_other_folder(info, user_dir, data_dir, str(folder))
            return "npz", resolved, stamps

    if info.torchvision is not None:
        tv_roots = _unique_paths(
            ([user_dir] if user_dir is not None else []) + [_TORCHVISION_CACHE.expanduser()]
        )
        for root in tv_roots:
            searched.append(f"torchvision:{root}")
            if layout_present(info.torchvision, root):
                if user_dir is not None and root != user_dir:
                    _say_other_folder(info, user_dir, data_dir, f"torchvision:{root}")
                return "torchvision", (str(root.resolve()),), ()
        if _downloads_allowed(allow_download):
            try:
                return "torchvision", (download_torchvision(info, user_dir, _TORCHVISION_CACHE.expanduser()),), ()
            except DataError as exc:
                raise DataError(
                    _not_found_message(
                        info, npz_dirs, user_dir, data_dir, allow_download, download_error=str(exc)
                    ),
                    dataset=info.name,
                    searched=searched,
                    path=exc.path,
                ) from exc

    raise DataError(
        _not_found_message(info, npz_dirs, user_dir, data_dir, allow_download),
        dataset=info.name,
        searched=searched,
    )


def _say_other_folder(info: DatasetInfo, user_dir: Path, data_dir: object, used: str) -> None:
    """Warn that the data folder set (``--data-dir`` / ``[data] data_dir`` / env) does not hold
    ``info`` and which folder was used instead: never a silent fallback (a folder that does not
    exist at all was warned about already, by :func:`user_data_dir`)."""
    if not user_dir.is_dir():
        return
    origin = "the data folder you set" if data_dir is not None else f"env {ENV_DATA_DIR}"
    log.warning("%s, %s, does not hold %s (%s): using %s", origin, user_dir, info.name,
                ", ".join(info.files) or "its files", used)


def user_data_dir(
    data_dir: str | os.PathLike[str] | None,
    *,
    then: str = "looking in the shared data folder and the torchvision cache instead",
) -> Path | None:
    """Step 1: the ``data_dir`` argument, else env ``FEDFLEET_DATA``, else None.

    A folder that does not exist is still returned (a download may go elsewhere, see step 3),
    but logged as a warning ending in ``then`` (what happens next): a typo there would otherwise
    fall back to the shared data folder without a word."""
    if data_dir is not None:
        folder, origin = Path(data_dir).expanduser(), "the data folder you set"
    else:
        env = os.environ.get(ENV_DATA_DIR, "")
        if not env:
            return None
        folder, origin = Path(env).expanduser(), f"env {ENV_DATA_DIR}"
    if not folder.is_dir():
        log.warning("%s, %s, is not an existing folder: %s", origin, folder, then)
    return folder


def npz_search_dirs(user_dir: Path | None) -> list[Path]:
    """Steps 1 and 2: the directories searched for the npz layout, in order, without repeats."""
    return _unique_paths(([user_dir] if user_dir is not None else []) + list(_SHARED_DATA_DIRS))


def _unique_paths(paths: Sequence[Path]) -> list[Path]:
    """``paths`` in order without those that resolve to a folder already listed."""
    seen: set[Path] = set()
    out: list[Path] = []
    for p in paths:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _file_stamp(path: Path) -> tuple[int, int]:
    """``(mtime_ns, size in bytes)`` of ``path``: part of the cache key of a loaded set."""
    st = path.stat()
    return (st.st_mtime_ns, st.st_size)


def _downloads_allowed(allow_download: bool | None) -> bool:
    """The download policy: ``allow_download`` if given, else not when env ``FEDFLEET_OFFLINE`` is ``"1"``."""
    if allow_download is None:
        return os.environ.get(ENV_OFFLINE, "") != "1"
    return bool(allow_download)


_HOW_TO_SET_DATA_DIR = (
    "`--data-dir DIR` on the command line (fedfleet and fedfleet-agent), "
    f"`[data] data_dir` in the config, `data_dir=` in Python, or the {ENV_DATA_DIR} environment "
    "variable"
)
"""How a user sets the data folder, in every front end's own words (used in DataError texts)."""


def _shown(path: Path) -> Path:
    """``path`` made absolute for messages (symlinks kept as the user wrote them)."""
    return Path(os.path.abspath(path))


def _misplaced_hint(info: DatasetInfo, user_dir: Path | None) -> tuple[str, Path] | None:
    """Detect the common mistake of giving the set's own folder instead of the data folder.

    Returns:
        ``(hint, folder to use instead)`` when ``user_dir`` directly holds every file of the set
        (``<user_dir>/train.npz`` and ``test.npz`` for mnist) or torchvision's layout one level
        too deep (``<user_dir>/raw/...`` with ``user_dir`` named ``MNIST``); else None.
    """
    if user_dir is None or not user_dir.is_dir():
        return None
    shown = _shown(user_dir)
    names = [Path(rel).name for rel in info.files]
    if names and all((user_dir / n).is_file() for n in names):
        found = "/".join(names)
        subdirs = sorted({Path(rel).parent.as_posix() for rel in info.files})
        if len(subdirs) == 1 and shown.name == subdirs[0]:
            return (
                f"found {found} directly in {shown}: pass its parent folder ({shown.parent}) as "
                "the data folder.",
                shown.parent,
            )
        wanted = " and ".join(info.files)
        return (
            f"found {found} directly in {shown}, but the data folder must hold them as {wanted}: "
            f"put them in a sub-folder {subdirs[0]}/ of the data folder (e.g. rename {shown} to "
            f"{shown.parent / subdirs[0]} and pass {shown.parent} as the data folder).",
            shown.parent,
        )
    if info.torchvision is not None:
        markers = TORCHVISION_MARKERS[info.torchvision]
        heads = {m.split("/", 1)[0] for m in markers}
        if len(heads) == 1 and all("/" in m for m in markers) and shown.name in heads:
            inner = [m.split("/", 1)[1] for m in markers]
            if all((user_dir / rel).is_file() for rel in inner):
                return (
                    f"found torchvision's {shown.name} layout ({inner[0]}, ...) directly in "
                    f"{shown}: pass its parent folder ({shown.parent}) as the data folder.",
                    shown.parent,
                )
    return None


def _not_found_message(
    info: DatasetInfo,
    npz_dirs: Sequence[Path],
    user_dir: Path | None,
    data_dir: str | os.PathLike[str] | None,
    allow_download: bool | None,
    *,
    download_error: str | None = None,
) -> str:
    """The text of the :class:`DataError` of step 4: every location searched, in order, with its
    state; a hint when the data folder given is the set's own folder; which files to put where;
    how to get torchvision's layout; and the set's own ``hint``."""
    lines = [f"data set {info.name!r} not found. Searched, in order:"]
    step = 1
    for folder in npz_dirs:
        if user_dir is not None and folder == user_dir:
            origin = "the data folder you set" if data_dir is not None else f"env {ENV_DATA_DIR}"
        else:
            origin = "shared data folder"
        if not folder.exists():
            state = ", does not exist"
        elif not folder.is_dir():
            state = ", is not a folder"
        else:
            state = ""
        lines.append(f"  ({step}) {folder}  [{origin}{state}]")
        step += 1
    if info.torchvision is not None:
        roots = _unique_paths(
            ([user_dir] if user_dir is not None else []) + [_TORCHVISION_CACHE.expanduser()]
        )
        for root in roots:
            lines.append(f"  ({step}) torchvision:{root}  [torchvision {info.torchvision} layout]")
            step += 1
        if download_error is not None:
            reason = download_error.strip().replace("\n", "\n      ")
            lines.append(f"  torchvision download: tried (download failed: {reason})")
        else:
            why = "allow_download=False" if allow_download is False else f"{ENV_OFFLINE}=1"
            lines.append(f"  torchvision download: not attempted (downloads are off: {why}).")
    if len(lines) == 1:
        lines.append(
            f"  (nothing: no data folder set, {ENV_DATA_DIR} not set, no shared data folder)"
        )
    misplaced = _misplaced_hint(info, user_dir)
    if misplaced is not None:
        lines.append(f"Hint: {misplaced[0]}")
    files = " and ".join(info.files)
    label_range = f"y int64 in [0, {info.num_classes})"
    what = f"{files} (x uint8 {info.x_shape_text}, {label_range})"
    if misplaced is not None:
        example = misplaced[1] / info.files[0]
        lines.append(
            f"The data folder must hold {what}, e.g. {example}; set the data folder with "
            f"{_HOW_TO_SET_DATA_DIR}."
        )
    elif npz_dirs:
        lines.append(
            f"Put {what} under one of the folders above (e.g. {npz_dirs[0] / info.files[0]}), or "
            f"under another folder and set that as the data folder: {_HOW_TO_SET_DATA_DIR}."
        )
    else:
        lines.append(
            f"Put {what} under a folder and set it as the data folder: {_HOW_TO_SET_DATA_DIR}."
        )
    if info.torchvision is not None:
        layout = f"torchvision's {info.torchvision} folder layout " + (
            f"({TORCHVISION_MARKERS[info.torchvision][0]}, ...)"
        )
        if download_error is not None:
            lines.append(f"Or put {layout} in the data folder, or retry the download when online.")
        elif allow_download is False:
            lines.append(
                f"Or let torchvision download it (allow_download=True in Python), or put {layout} "
                "in the data folder."
            )
        else:
            lines.append(
                f"Or let torchvision download it (unset {ENV_OFFLINE}, or allow_download=True in "
                f"Python), or put {layout} in the data folder."
            )
    if info.hint:
        lines.append(info.hint)
    return "\n".join(lines)
