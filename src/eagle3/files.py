"""Crash-safe output files: every file or directory appears complete or not at all.

`atomic_write` and `atomic_dir` write under a temporary name beside the destination, fsync,
then rename into place and fsync the parent directory, so `kill -9` (or a power cut) at any
moment leaves either the previous version or the new one, never a torn file. Temporaries that
a killed process left behind carry its pid and are removed by the next writer of the same
name. An `OSError` (full disk, read-only file system, no permission) becomes a one-line
`Eagle3Error` and leaves the previous version untouched. `check_writable` refuses an output
directory that cannot be written or lacks room, before long work starts.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from .errors import Eagle3Error

_PARTIAL = ".partial-"  # temporaries are named .<name>.partial-<pid>-<random>
_PREVIOUS = ".previous-"  # a directory's previous version, moved aside while the new one moves in


def fsync_dir(path: str) -> None:
    """Make a rename or new entry in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the rename still happened
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def write_error(path: str, e: OSError) -> Eagle3Error:
    """The one-line error for a failed write to `path`, with the fix for the common causes."""
    why = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        fix = "free some disk space or choose another directory"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        fix = "choose a writable directory"
    else:
        fix = "check the disk and the path"
    return Eagle3Error(f"cannot write {path} ({why}); {fix}; the previous version, if any, is unchanged")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(entry: str, prefix: str) -> bool:
    """Whether `entry` (named prefix + pid + ...) belongs to a process that no longer runs; our
    own pid counts too: a reused pid of a killed earlier run (one writer per path per process)."""
    pid = entry[len(prefix):].split("-", 1)[0]
    return pid.isdigit() and (pid == str(os.getpid()) or not _alive(int(pid)))


def clean_stale(path: str) -> None:
    """Tidy what killed writers of `path` left: a previous version moved aside is put back when
    `path` is missing (the kill fell between the two renames), every other temporary removed."""
    parent, name = os.path.split(os.path.abspath(path))
    prefix, previous = f".{name}{_PARTIAL}", f".{name}{_PREVIOUS}"
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if entry.startswith(previous) and _stale(entry, previous):
            if not os.path.lexists(path):
                os.replace(os.path.join(parent, entry), path)
            else:
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        if _stale(entry, prefix):
            stale = os.path.join(parent, entry)
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale, ignore_errors=True)
            else:
                try:
                    os.unlink(stale)
                except OSError:
                    pass


_UMASK: list[int] = []


def _mode(base: int) -> int:
    """`base` less the process umask: mkstemp / mkdtemp create 0600 / 0700, open() would not."""
    if not _UMASK:
        _UMASK.append(os.umask(0o022))  # reading the umask means setting it; put it straight back
        os.umask(_UMASK[0])
    return base & ~_UMASK[0]


def _temp_prefix(path: str) -> tuple[str, str]:
    parent, name = os.path.split(os.path.abspath(path))
    return parent, f".{name}{_PARTIAL}{os.getpid()}-"


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on success it replaces `path` durably.

    On any exception the temporary is removed and `path` is left as it was; an `OSError`
    becomes a one-line `Eagle3Error`.
    """
    if "w" not in mode:
        raise ValueError(f"atomic_write needs a write mode, got {mode!r}")
    path = os.fspath(path)
    clean_stale(path)
    parent, prefix = _temp_prefix(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=parent)
        os.chmod(tmp, _mode(0o666))
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_dir(parent)
    except OSError as e:
        raise write_error(path, e) from None
    finally:
        if tmp is not None:
            _remove(tmp)


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[str]:
    """A temporary directory beside `path` to fill; on success it replaces `path` durably.

    An existing `path` is replaced as a whole (moved aside under a `.previous-` name, then
    removed once the new one is in place; a kill between the two renames is repaired by the
    next writer, which puts it back); on any exception the temporary is removed and `path`
    is left as it was.
    """
    path = os.fspath(path)
    clean_stale(path)
    parent, prefix = _temp_prefix(path)
    tmp = old = None
    try:
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
        os.chmod(tmp, _mode(0o777))
        yield tmp
        for root, _, names in os.walk(tmp):
            for name in names:
                fsync_file(os.path.join(root, name))
            fsync_dir(root)
        if os.path.isdir(path) and not os.path.islink(path):
            try:
                os.rmdir(path)  # empty: simply replaced
            except OSError:
                old = tempfile.mkdtemp(prefix=prefix.replace(_PARTIAL, _PREVIOUS), dir=parent)
                os.replace(path, old)  # moved aside: a kill now leaves it for clean_stale to restore
        os.replace(tmp, path)
        tmp = None
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)  # only once the new version is in place
            old = None
    except BaseException as e:
        if old is not None and not os.path.lexists(path):
            try:
                os.replace(old, path)  # put the previous version back
            except OSError:
                pass  # it stays under its .previous- name; the next writer's clean_stale restores it
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(path: str | os.PathLike, need_bytes: int | None = None, what: str = "--out") -> None:
    """Create directory `path` if needed and check that a file can be written in it and, with
    `need_bytes`, that its file system has about that much room; else a one-line `Eagle3Error`."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".write-test{_PARTIAL}{os.getpid()}-", dir=path)
        try:
            os.write(fd, b"x")
            os.fsync(fd)
        finally:
            os.close(fd)
            _remove(probe)
    except OSError as e:
        fix = "free some disk space or choose another directory" if e.errno == errno.ENOSPC else \
            "choose a writable directory"
        raise Eagle3Error(f"cannot write to {what} {path} ({e.strerror or e}); {fix}") from None
    if need_bytes:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            raise Eagle3Error(f"not enough free space for {what} {path}: {_size(free)} free, about "
                              f"{_size(need_bytes)} needed; free some disk space or choose another "
                              "directory")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
