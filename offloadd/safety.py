"""What the daemon checks before it trusts a file, a directory or a client's string.

Pure helpers that return a problem (``""`` when there is none), so each caller raises its
own error with the setting to fix:

- ``private_dir_problem(path)``: a directory the daemon keeps sockets, locks, the journal or
  its key in must be a real directory (not a symlink) owned by the daemon's user (or root)
  and writable by nobody else, or another local user could replace what is in it.
- ``secret_file_problem(path)``: a key file must be a regular file of the daemon's user (or
  root) that neither group nor others can read or write.
- ``read_secret(path, size)`` / ``write_secret(path, secret)``: a key file read only when it
  passes that check, and created only where nothing is (never through a link, never over an
  existing key, 0600 from its first byte, whole when it appears).
- ``owner_name(uid)``: who owns a file, for those messages; ``UnsafePath``: the error a
  caller raises with one of them (the daemon refuses to start on it).
- ``engine_id_problem(engine_id)``: engine ids are names in logs, metrics labels and event
  topics, so they are held to a short safe alphabet (vLLM's uuid4 ids and their ``_dpN``
  suffixes fit).
- ``printable(text)``: a client string for a log line, control characters escaped the way
  ``repr`` does, so a client cannot forge or split log lines.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat

_ENGINE_ID = re.compile(r"[A-Za-z0-9_.:@/+\-]{1,128}\Z")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class UnsafePath(Exception):
    """A configured file or directory others could change; the message names it and the fix."""


def _trusted_owner(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def private_dir_problem(path: str) -> str:
    """Why ``path`` is not a directory only the daemon's user can change ("" when it is)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link; point the setting at the real directory"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if not _trusted_owner(info.st_uid):
        return (
            f"{path} belongs to uid {info.st_uid}, not to the daemon's user (uid "
            f"{os.geteuid()}): another user could replace what the daemon keeps there"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        return (
            f"{path} is writable by {'others' if mode & 0o002 else 'its group'} (mode "
            f"{mode:04o}): they could replace what the daemon keeps there; "
            f"run chmod go-w {path}, or use another directory"
        )
    return ""


def secret_file_problem(path: str, info: os.stat_result | None = None) -> str:
    """Why ``path`` is not a secret only the daemon's user can read ("" when it is).

    ``info``: the file's ``fstat`` when the caller has it open already.
    """
    if info is None:
        try:
            info = os.stat(path)
        except OSError as exc:
            return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if not _trusted_owner(info.st_uid):
        return f"{path} belongs to uid {info.st_uid}, not to the daemon's user"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return (
            f"{path} is readable or writable by group or others (mode {mode:04o}); "
            f"run chmod 600 {path}"
        )
    return ""


def read_secret(path: str, size: int) -> bytes | str:
    """The ``size``-byte secret at ``path`` (opened without following a link, checked by
    ``secret_file_problem``), or why it cannot be used. ``FileNotFoundError`` propagates, so
    that a caller may create the secret instead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        return f"{path}: {exc.strerror}"
    try:
        problem = secret_file_problem(path, os.fstat(fd))
        if problem:
            return problem
        secret = os.read(fd, size + 1)
    finally:
        os.close(fd)
    if len(secret) != size:
        return f"{path} is not a {size}-byte key"
    return secret


def write_secret(path: str, secret: bytes) -> None:
    """Create ``path`` holding ``secret``, mode 0600, synced to disk.

    The bytes go to a temporary file beside it (in a directory that should be private:
    ``private_dir_problem``), created exclusively (``O_EXCL``, no link followed) and fsynced,
    then linked to ``path``: a reader never sees a part-written key, and a key that is there
    already (another process's, made meanwhile) is never replaced: that raises
    ``FileExistsError`` naming ``path``, so a caller may read that key instead. Any other
    ``OSError`` (no such directory, permission) propagates."""
    temporary = f"{path}.{os.urandom(8).hex()}.tmp"  # unique, even for a pid 1 restarted
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        try:
            view = memoryview(secret)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)  # atomic, and fails where a file (or a link) is
        except FileExistsError:
            raise FileExistsError(
                errno.EEXIST, f"{path} exists already; a key is never written over", path
            ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)  # the new name survives a crash with the bytes it names
    finally:
        os.close(directory)


def owner_name(uid: int) -> str:
    """``uid N (name)`` for messages that name who owns a file."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def engine_id_problem(engine_id: str) -> str:
    """Why ``engine_id`` is refused ("" when it is fine)."""
    if _ENGINE_ID.match(engine_id):
        return ""
    shown = repr(engine_id[:64]) + ("..." if len(engine_id) > 64 else "")
    return f"engine_id {shown} must be 1 to 128 characters of letters, digits and . _ : @ / + -"


def printable(text: str) -> str:
    """``text`` with control characters escaped as ``repr`` would (for log lines)."""
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
