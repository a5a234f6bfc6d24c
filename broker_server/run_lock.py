"""One process at a time in a run folder: the lock a ``fedfleet server``, a ``fedfleet simulate``
and a reproduction grid (:func:`broker_server.experiments.run_grid`, on its grid folder) hold on
the folder they write for as long as they write it.

Two processes in one run folder (a ``--resume`` while the run's server still runs, two resumes,
two servers started with one ``--out``) would both append to its ``metrics.jsonl``, its ledger and
its checkpoints and replace its ``broker.json``: the second is refused at once
(:class:`~broker_server.errors.RunFolderBusy`, ``fedfleet`` exit 5), naming the folder and the
holder (its command, pid, host and start time, which the holder writes into the lock file).

The mechanism is :func:`fcntl.flock` (an exclusive, non-blocking lock on an open file of the
folder, :data:`LOCK_NAME`): the kernel releases it when the holding process ends, however it
ends (a SIGKILL, a power cut), so a killed server never leaves a lock that blocks its own
``--resume``; the lock file it leaves (its holder's record, stale) is taken over by the next
process. A holder that ends normally removes the file. The file is opened close-on-exec, so a
child process (the embedded broker) does not keep the lock after its parent died.

Platforms without :mod:`fcntl` (Windows), and file systems that refuse ``flock`` (some network
mounts), run without the lock: a WARNING says once per folder that the folder is not protected
against a second process.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import logging
import os
import socket
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, RunFolderBusy

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: the folder is not locked (said in a warning)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

__all__ = ["LOCK_NAME", "Holder", "RunFolderLock", "check_not_held", "hold_run_folder"]

#: The lock file in a locked folder (it holds the holder's record, :class:`Holder`, as JSON).
LOCK_NAME = "run.lock"

#: ``flock`` errors that say the file system cannot lock (not that another process holds it).
_NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class Holder:
    """The process that holds a run folder, as it wrote itself into the lock file.

    Attributes:
        command: what it runs (``"fedfleet server"``, ``"fedfleet simulate"``, ``"a reproduction grid"``).
        pid: its process id (on ``host``).
        host: the host name of its machine (:func:`socket.gethostname`).
        started: when it took the lock, ISO 8601 local time with its UTC offset, to the second.
    """

    command: str
    pid: int
    host: str
    started: str

    def describe(self) -> str:
        """``fedfleet server, pid 4242 on host pi-lab, started 2025-05-01T10:00:00+02:00``."""
        return f"{self.command}, pid {self.pid} on host {self.host}, started {self.started}"


class RunFolderLock:
    """The lock on one run folder, held from :meth:`acquire` to :meth:`release`
    (:func:`hold_run_folder` is both around a block).

    Args:
        run_dir: the folder (created, with its parents, when missing; the folders it created
            that are empty at :meth:`release` are removed again, the run folder first).
        command: what the holder runs, as a refusal names it (:attr:`Holder.command`).
    """

    def __init__(self, run_dir: str | os.PathLike, command: str) -> None:
        self.run_dir = Path(run_dir)
        self.command = command
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (``False`` where the platform cannot lock)."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or refuse at once; write this process's :class:`Holder` into the lock file.

        Raises:
            RunFolderBusy: another process holds the folder (its holder named, when it wrote itself).
            ConfigError: the folder or its lock file cannot be made or opened (a file in its place,
                a folder this user may not write), or the lock file is not a regular file (a
                symbolic link, which is never followed, a FIFO, a folder …): the message names the
                path and why; nothing is written.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: this lock is held already")
        missing = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        try:
            self.run_dir.mkdir(parents=True)
            self._created = missing  # this call made them (another process may have made some meanwhile)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(f"{self.run_dir}: the run folder cannot be made ({exc.strerror or exc})") from exc
        if not self.run_dir.is_dir():
            raise ConfigError(f"{self.run_dir}: a file, not a run folder")
        if fcntl is None:  # pragma: no cover - Windows
            log.warning("%s: run folders are not locked on this platform (no fcntl): nothing stops a second "
                        "process from writing this folder at the same time", self.run_dir)
            return
        for _ in range(20):  # the file replaced between open and flock: a holder just removed it
            try:
                fd = _open_lock_file(self.path, os.O_RDWR | os.O_CREAT)
            except OSError as exc:
                raise ConfigError(f"{self.path}: the run folder's lock file cannot be opened "
                                  f"({exc.strerror or exc})") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise RunFolderBusy(self.run_dir, holder) from None
                os.close(fd)
                if exc.errno in _NO_LOCKING:
                    log.warning("%s: the file system does not lock files (%s): nothing stops a second process "
                                "from writing this folder at the same time", self.run_dir, exc.strerror or exc)
                    return
                raise ConfigError(f"{self.path}: the run folder cannot be locked ({exc.strerror or exc})") from exc
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder removed as it released it: lock the one there now
        else:  # pragma: no cover - twenty holders in a row released under this process
            raise RunFolderBusy(self.run_dir, None)
        self._fd = fd
        now = _dt.datetime.now().astimezone().replace(microsecond=0)
        holder = Holder(command=self.command, pid=os.getpid(), host=socket.gethostname(), started=now.isoformat())
        data = (json.dumps({"command": holder.command, "pid": holder.pid, "host": holder.host,
                            "started": holder.started}) + "\n").encode("utf-8")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as exc:  # a full disk: the lock holds, a refusal names no holder
            log.warning("%s: the holder cannot be written (%s); the folder is locked all the same",
                        self.path, exc.strerror or exc)

    def release(self) -> None:
        """Give the lock back: the lock file is removed (when it is still this lock's), then closed,
        and the folders :meth:`acquire` made that are left empty are removed. A second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if _same_file(fd, self.path):  # removed while locked: no process can lock this file after it
                    self.path.unlink()
            except OSError:
                pass
            os.close(fd)
        made, self._created = self._created, []
        for folder in made:  # the run folder first, then the parents made for it
            try:
                folder.rmdir()
            except OSError:  # not empty (the run wrote its files), or gone
                break


@contextmanager
def hold_run_folder(run_dir: str | os.PathLike, command: str) -> Iterator[RunFolderLock]:
    """Hold the lock on ``run_dir`` around the block (:class:`RunFolderLock`), released however
    the block ends.

    Raises:
        RunFolderBusy, ConfigError: as :meth:`RunFolderLock.acquire`, before the block runs.
    """
    lock = RunFolderLock(run_dir, command)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


def check_not_held(run_dir: str | os.PathLike) -> None:
    """Refuse now, before a command prints or reads anything, a folder another process holds;
    writes nothing (a missing folder or lock file is not held). The lock itself is taken later
    (:func:`hold_run_folder`), which refuses a process that came in between.

    Raises:
        RunFolderBusy: another process holds ``run_dir`` (its holder named, when it wrote itself).
        ConfigError: its lock file is not a regular file (a symbolic link, a FIFO, a folder …):
            the message names the path and what is there; nothing is opened through it.
    """
    if fcntl is None:  # pragma: no cover - Windows: not locked
        return
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = _open_lock_file(path, os.O_RDONLY)
    except OSError:  # no lock file (not held), or one this user cannot read: the lock itself says
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunFolderBusy(Path(run_dir), _read_holder(fd)) from None
    finally:
        os.close(fd)


#: Flags of every open of a lock file: close-on-exec (a child does not keep the lock), no symbolic
#: link followed (a ``run.lock`` linked to another file would have that file truncated and
#: overwritten), no waiting (a FIFO in its place would block the open until a writer came).
_OPEN_FLAGS = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _open_lock_file(path: Path, flags: int) -> int:
    """``path`` opened with ``flags`` (and :data:`_OPEN_FLAGS`) when it is a regular file (or
    ``flags`` created it one). Anything else in its place (a symbolic link, a FIFO, a folder, a
    device, a socket) is refused, never written to: not opened, or closed again at once.

    Raises:
        ConfigError: not a regular file: the message names the path and what is there (a link's
            target too).
        OSError: it cannot be opened otherwise (none there, no permission), as :func:`os.open`.
    """
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, 0o644)
    except OSError:
        if (kind := _kind_of(path)) is not None:  # a symbolic link (ELOOP), a FIFO with no reader (ENXIO) …
            raise _not_regular(path, kind) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, _kind_name(mode))
    return fd


def _not_regular(path: Path, kind: str) -> ConfigError:
    """The refusal of a lock file ``path`` that is ``kind``, not a regular file."""
    return ConfigError(f"{path}: the run folder's lock file is {kind}, not a regular file; fedfleet neither "
                       "follows nor writes it: remove it (or choose another run folder) and try again")


def _kind_of(path: Path) -> str | None:
    """What is at ``path`` when it is not a regular file (``"a symbolic link to ..."``, ``"a FIFO"``
    ...), ``None`` for a regular file or nothing (or a path that cannot be looked at)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            return "a symbolic link"
        return f"a symbolic link (to {target})"
    return None if stat.S_ISREG(st.st_mode) else _kind_name(st.st_mode)


def _kind_name(mode: int) -> str:
    """The kind of file ``mode`` says, as a message names it (``"a folder"``, ``"a FIFO"`` ...)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file open as ``fd`` (``False``: removed or replaced)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_holder(fd: int) -> Holder | None:
    """The :class:`Holder` written in the lock file open as ``fd``, or ``None`` when there is none
    yet (its holder is starting) or it cannot be read."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return Holder(command=str(data["command"]), pid=int(data["pid"]), host=str(data["host"]),
                      started=str(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
