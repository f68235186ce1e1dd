"""Atomic file replacement: write a temporary file, fsync it, rename it over the target, fsync the directory.

A reader sees either the previous file or the complete new one, never a
partial write, even if the writing process is killed or the machine loses
power in the middle: the rename is the commit point. A killed writer may
leave a temporary file (``.NAME.tmp-PID-RANDOM``) beside the target; it is
never read, and :func:`stale_temporaries` lists such files for cleanup. Where
that name would pass the file system's limit on a name's bytes (``NAME`` near
it), ``NAME`` is shortened and followed by ``~`` and a hash of the whole name.

A save over a file keeps its permission bits (its temporary has them for
the group and others from its creation, before any data is written), and one
over a file this process may not write is refused, as ``open(path, "w")`` (and so
``torch.save``) would have it. A save to a symbolic link writes through it,
as ``open(path, "w")`` would: the link stays, and its target (created if the
link dangles) is the file replaced, its temporary beside it. A path that is a
FIFO or a device node (``/dev/null``) is refused: the rename would replace the
node itself with a regular file.

The new file is a new inode (``torch.save`` truncates the old one in place):
other hard links to the old file keep the old data, and of the old file's
metadata only the permission bits carry over (its owner where another user's
file is replaced as root, ACLs and extended attributes do not).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import stat
import uuid
from errno import EACCES, EROFS
from typing import Callable

from sofx.checkpoint.errors import CheckpointError, CheckpointIOError, check_path, system_error
from sofx.durable import fsync_where_supported
from sofx.errors import SofxError

__all__ = ["atomic_write", "check_destination", "stale_temporaries", "fsync_directory", "special_kind"]


# The bytes a temporary name adds to the target's: the leading ".", ".tmp-", the pid (at most 10 digits), "-" and
# 12 random hex digits.
_TEMPORARY_EXTRA_BYTES = 1 + len(".tmp-") + 10 + 1 + 12
_DEFAULT_NAME_MAX = 255  # Linux, macOS and Windows file systems


def _name_max(directory: str, default: int | None = _DEFAULT_NAME_MAX) -> int | None:
    """The longest file name (in bytes) the file system holding ``directory`` allows (``default`` where the system
    does not say)."""
    try:
        limit = int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError, TypeError):  # no pathconf (Windows), or no limit reported (None)
        return default
    return limit if limit > 0 else default  # (-1: no limit)


def _temporary_prefix(path: str) -> str:
    """``DIR/.NAME.tmp-`` for ``path = DIR/NAME``: every temporary file of a save to ``path`` starts so. A
    ``NAME`` too long for the temporary's name to fit the file system's limit (a name within it, say 250 bytes,
    is valid, and the temporary adds 29) is cut to fit, followed by ``~`` and 12 hex digits of its hash."""
    directory, base = os.path.split(path)
    room = _name_max(directory or ".") - _TEMPORARY_EXTRA_BYTES
    if len(os.fsencode(base)) > room:
        digest = hashlib.sha256(os.fsencode(base)).hexdigest()[:12]
        while base and len(os.fsencode(base)) > room - 1 - len(digest):
            base = base[:-1]  # whole characters: a multi-byte one is never split
        base = f"{base}~{digest}"
    return os.path.join(directory, f".{base}.tmp-")


def _temporary_name(path: str) -> str:
    return f"{_temporary_prefix(path)}{os.getpid()}-{uuid.uuid4().hex[:12]}"


_TEMPORARY_SUFFIX = re.compile(r"[0-9]{1,10}-[0-9a-f]{12}")  # what _temporary_name puts after the prefix


def stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Temporary files left beside ``path`` (beside its target where ``path`` is a symbolic link) by interrupted
    saves (safe to delete when no save is running): the files named ``.NAME.tmp-PID-RANDOM`` exactly, not a
    sibling that only starts so (the temporary of a target named ``NAME.tmp-...``, a user's own file)."""
    path = check_path("stale_temporaries", path)
    prefix = _temporary_prefix(os.path.realpath(path))
    return sorted(p for p in glob.glob(glob.escape(prefix) + "*")
                  if _TEMPORARY_SUFFIX.fullmatch(p[len(prefix):]))


def fsync_directory(directory: str) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened, e.g. Windows, or where
    the file system does not sync them); an I/O error there (``EIO``) is raised: the rename may not survive a power
    loss. (It was ignored, as an unsupported fsync: a save reported done that a crash could take back.)"""
    fsync_where_supported(directory)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def system_errno(exc: BaseException) -> int | None:
    """The operating system's error number behind ``exc``: an ``OSError``'s, or the one that safetensors
    (Rust) writes into its own exception's message, ``"... (os error 28)"``; ``None`` for other failures."""
    if isinstance(exc, OSError):
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def _destination(path: str | os.PathLike) -> tuple[str, str]:
    """``(the absolute path, the file a save to it replaces)``: the second is the first with every symbolic
    link resolved (a link's target, created if the link dangles), after checking that a file can be committed
    there: it does not end in a path separator (nor in ``.`` or ``..``), its directory exists and this process may
    write it (:func:`_check_directory_writable`), its name fits the file system's limit, it is not itself a
    directory nor another file that is not a regular one (a FIFO, a device), and it is not a link that loops
    (:class:`CheckpointError` otherwise, before anything is written)."""
    given = os.fsdecode(path)
    if given.endswith(tuple(sep for sep in (os.sep, os.altsep) if sep)):
        # (abspath drops the separator: "run/ckpt/" wrote a file run/ckpt, which load("run/ckpt/") did not find)
        raise CheckpointError(f"cannot save {given}: the path ends in a path separator, so it names a directory; "
                              "expected the path of a file")
    last = re.split("|".join(re.escape(sep) for sep in (os.sep, os.altsep) if sep), given)[-1]
    if last in (os.curdir, os.pardir):  # (abspath drops "ckpt/." too: it replaced the file ckpt, open() refuses it)
        raise CheckpointError(f"cannot save {given}: the path ends in {last!r}, so it names a directory; expected the "
                              "path of a file")
    path = _absolute(given)
    if not os.path.isdir(os.path.dirname(path)):  # (the system's answer: realpath drops "nodir/.." as text)
        directory = os.path.dirname(path)
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(f"cannot save {path}: the directory {directory} {what}")
    target = os.path.realpath(path)
    if os.path.islink(target):  # realpath leaves unresolved only a link that loops
        raise CheckpointError(f"cannot save {path}: a symbolic link that loops (at {target})")
    named = f"{path} (a symbolic link to {target})" if os.path.islink(path) else path
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(f"cannot save {named}: the directory {directory} {what}")
    # A name over the limit: the temporary's name is cut to fit, and only the rename found it out, after the whole
    # write. (Where the system reports no limit in bytes, Windows, the write's open says it.)
    name_bytes, name_max = len(os.fsencode(os.path.basename(target))), _name_max(directory, None)
    if name_max is not None and name_bytes > name_max:
        raise CheckpointError(f"cannot save {named}: the file name is {name_bytes} bytes long; this file system "
                              f"allows at most {name_max}")
    if os.path.isdir(target):
        raise CheckpointError(f"cannot save {named}: it is a directory")
    kind = _special_kind(target)
    if kind is not None:  # (the rename replaced the node itself: save("/dev/null") as root, /dev/null)
        raise CheckpointError(f"cannot save {named}: it is {kind}, not a regular file; a save renames a new file "
                              "over its path, which would replace it (save to a regular file's path)")
    if os.path.exists(target) and not os.access(target, os.W_OK):  # (open(path, "w") and torch.save refuse it)
        raise CheckpointError(f"cannot save {named}: the file is read-only for this process; the rename of a "
                              "save would replace it all the same (make it writable, or save elsewhere)")
    _check_directory_writable(named, directory)
    return path, target


def _check_directory_writable(named: str, directory: str) -> None:
    """:class:`CheckpointIOError` (``EACCES``, or ``EROFS`` on a read-only file system) where this process may not
    create a file in ``directory``, as ``torch.save``'s ``open()`` raises ``PermissionError`` at once: the save's
    temporary found it only when created, after ``save`` encoded the tree and ``save_async`` copied it. POSIX only:
    Windows' read-only attribute on a directory, which ``os.access`` reports, does not keep files out of it."""
    if os.name != "posix" or os.access(directory, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    where = " (a read-only file system)" if read_only else ""
    raise system_error(f"cannot save {named}: the directory {directory} is not writable by this process{where}; a "
                       "save creates its file there (make it writable, or save elsewhere)",
                       EROFS if read_only else EACCES)


def _absolute(given: str) -> str:
    """``given`` as an absolute path naming the file the system would open for it. ``os.path.abspath`` also drops
    ``DIR/..`` as text, where a POSIX system goes up from wherever ``DIR`` leads (a symbolic link's target's parent)
    or fails (no ``DIR``): ``save("run/../x")``, ``run`` a link, wrote another file than the one ``open`` and
    ``load`` find. A path with ``..`` is kept as given (made absolute) but for its directory's links, resolved where
    the directory exists."""
    if os.name != "posix":  # (Windows itself drops DIR/.. as text, as abspath does)
        return os.path.abspath(given)
    joined = os.path.join(os.getcwd(), given)
    if os.pardir not in joined.split(os.sep):
        return os.path.abspath(given)
    directory, name = os.path.split(joined)
    return os.path.join(os.path.realpath(directory), name) if os.path.isdir(directory) else joined


_SPECIAL_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                  (stat.S_ISSOCK, "a socket"))


def _special_kind(target: str) -> str | None:
    """What the file ``target`` (links resolved) is where it exists and is neither a regular file nor a directory
    ("a FIFO", "a character device", ...); ``None`` otherwise."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return None
    return special_kind(mode)


def special_kind(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is where it is neither a regular file nor a directory ("a FIFO", "a
    character device", ...); ``None`` otherwise."""
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "a special file")


def check_destination(path: str | os.PathLike) -> str:
    """The absolute ``path``, after checking that a file can be committed there (or, where ``path`` is a
    symbolic link, at its target): :class:`CheckpointError` otherwise, before anything is written."""
    return _destination(path)[0]


def _create_temporary(tmp: str, target: str) -> tuple[int, int]:
    """Create the empty file ``tmp`` (it must not exist); return a descriptor open on it (for its fsync: it needs no
    permission then) and the permission bits it is to have: those of the file ``target`` it will replace, if there
    is one (a save over a file keeps its mode, as ``torch.save``, which truncates it in place, does), else the
    default ones (``0o666`` less the umask, as ``open()`` gives a new file). Until it is written it has those bits
    for the group and others, before any byte is written (a temporary with the default mode held a 0600
    checkpoint's data readable by all while it was written, and, left by a killed save, afterwards), and read and
    write for its owner, the writer (which opens it again by its name)."""
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if mode is not None else 0o666)
    try:
        final = mode if mode is not None else stat.S_IMODE(os.fstat(fd).st_mode)
        writing = (final & 0o077) | 0o600
        if writing != stat.S_IMODE(os.fstat(fd).st_mode):
            os.chmod(tmp, writing)
    except BaseException:
        os.close(fd)
        raise
    return fd, final


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> str:
    """Call ``write(tmp)`` to write a temporary file (created empty: ``write`` opens it by its name and writes into
    it, as ``open(tmp, "wb")`` does, or renames a file of its own over it), then commit it as ``path``; returns the
    absolute ``path``.

    A symbolic link ``path`` is written through: its target is the file replaced (the temporary beside it), and
    the link stays. On any failure (including ``KeyboardInterrupt``) the temporary file is removed and ``path``
    is left as it was.
    """
    path, target = _destination(path)
    directory = os.path.dirname(target)
    tmp = _temporary_name(target)
    fd = None
    try:
        fd, mode = _create_temporary(tmp, target)
        write(tmp)  # (into the file created, opened for writing by its name)
        written, created = os.stat(tmp), os.fstat(fd)
        if stat.S_IMODE(written.st_mode) != mode:
            os.chmod(tmp, mode)  # its own mode, before the fsync (which makes it durable with the data)
        if (written.st_dev, written.st_ino) == (created.st_dev, created.st_ino):
            os.fsync(fd)
        else:  # a writer that renamed a file of its own over tmp
            _fsync_file(tmp)
        fd, created_fd = None, fd
        os.close(created_fd)  # (released even where it fails: never closed again, another thread may have its number)
        os.replace(tmp, target)
    except BaseException as exc:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, Exception) and not isinstance(exc, SofxError):
            # a full disk, a quota, an I/O error in the writer (safetensors', torch.save's): named, one type
            errno = system_errno(exc)
            at_system = isinstance(exc, OSError) or errno is not None
            error = CheckpointIOError if at_system else CheckpointError
            failure = error(f"cannot save {path}: {type(exc).__name__}: {exc} (the previous file, if any, is "
                            "unchanged)")
            failure.errno = errno if at_system else None
            raise failure from exc
        raise
    try:
        fsync_directory(directory)
    except OSError as exc:
        raise system_error(f"saved {path}, but the fsync of its directory {directory} failed: "
                           f"{type(exc).__name__}: {exc}; the file is in place, but a crash or power loss may still "
                           "take the save back (to the previous file, if any)", exc.errno) from exc
    return path
