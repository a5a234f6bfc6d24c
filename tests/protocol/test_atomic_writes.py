"""protocol.files: whole-file replacement, as the ONNX export, the FedDO policy, results files, the
broker child's port file and the security folder use it."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest

from protocol.files import fsync_dir, write_atomically, write_private


def test_the_new_contents_replace_the_old_and_no_temporary_file_stays(tmp_path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_bytes(b"old\n")
    write_atomically(path, b"new\n")
    assert path.read_bytes() == b"new\n"
    write_atomically(tmp_path / "fresh.bin", b"")
    assert (tmp_path / "fresh.bin").read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.bin", "results.jsonl"]


def test_modes_follow_the_argument_less_the_umask(tmp_path) -> None:
    """0666 less umask 022 is 0644 (as open() makes a file); write_private's 0600 stays 0600, also
    when it replaces a file that was readable by others."""
    old = os.umask(0o022)
    try:
        write_atomically(tmp_path / "model.onnx", b"x")
        (tmp_path / "key.pem").write_bytes(b"public")
        os.chmod(tmp_path / "key.pem", 0o644)
        write_private(tmp_path / "key.pem", b"secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.onnx").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "key.pem").stat().st_mode) == 0o600
    assert (tmp_path / "key.pem").read_bytes() == b"secret"


def test_a_failed_rename_leaves_the_old_file_and_removes_the_temporary_one(tmp_path, monkeypatch) -> None:
    path = tmp_path / "policy.pt"
    path.write_bytes(b"good")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        write_atomically(path, b"new")
    assert path.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["policy.pt"]


def test_a_write_past_the_file_size_limit_leaves_the_old_file(tmp_path) -> None:
    """A process whose files may not exceed 4 KiB (RLIMIT_FSIZE: a write past it fails as on a full
    disk, EFBIG) writing 8 KiB over a 10-byte file: OSError, the old bytes, nothing else left."""
    path = tmp_path / "port"
    path.write_bytes(b"1883\n12345")
    code = ("import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "from protocol.files import write_atomically\n"
            "try:\n"
            f"    write_atomically({str(path)!r}, b'x' * 8192, fsync=True)\n"
            "except OSError as exc:\n"
            "    print('refused', exc.errno)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["refused", str(errno.EFBIG)], done.stderr
    assert path.read_bytes() == b"1883\n12345"
    assert [p.name for p in tmp_path.iterdir()] == ["port"]


def test_a_missing_folder_is_an_oserror_and_fsync_dir_flushes_a_folder(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "absent" / "file", b"x")
    assert list(tmp_path.iterdir()) == []
    fsync_dir(tmp_path)  # a real folder: no error
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "absent")


def test_a_path_that_names_no_file_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for where in (".", "", "/"):
        with pytest.raises(IsADirectoryError):
            write_atomically(where, b"x")
    with pytest.raises(IsADirectoryError):  # a folder's path: the rename onto it fails
        write_atomically(tmp_path, b"x")
    assert list(tmp_path.iterdir()) == []


def test_a_second_stop_signal_during_a_write_removes_its_temporary_file(tmp_path) -> None:
    """A process with fedfleet's stop handlers whose write is inside an atomic() step gets SIGINT
    twice before the rename (the first is held until the step ends, the second exits at once):
    exit 130, no target and no temporary file left."""
    code = ("import os, signal\n"
            "import protocol.files as files\n"
            "from protocol.lifecycle import atomic, install_signal_handlers\n"
            "install_signal_handlers()\n"
            "def stop_twice(src, dst):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    raise AssertionError('the second SIGINT did not end the process')\n"
            "files.os.replace = stop_twice\n"
            f"atomic(files.write_atomically)({str(tmp_path / 'policy.pt')!r}, b'x' * 100_000)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert "second SIGINT: exiting at once" in done.stderr
    assert list(tmp_path.iterdir()) == []
