"""Exclusive locks between processes through a file, also where `flock` is not supported.

`flock` is the first choice: the kernel releases it when its holder dies. The lock file is
opened read-write (created when missing), else read-only: `flock` needs no write access, so
users sharing a folder lock each other out although the file is another user's. A lock file
that cannot be opened at all (no permission, or a symbolic link, which is never followed)
counts as held by someone else, never as "no lock here": a job then waits or is refused, it
never runs unlocked beside another (`denied` says why).

Some shared filesystems refuse `flock` (Lustre mounted with `noflock`, some NFS setups:
ENOLCK, EOPNOTSUPP, ENOSYS, EINVAL: any error but "held by another"); there the lock is a
second file created atomically (`O_CREAT | O_EXCL`) holding its owner's host, pid and a random
token. Such a file outlives a crashed holder, so it is a lease: its owner touches it every
`LEASE_REFRESH_S` (a daemon thread, through its own descriptor), and a file not touched for
`LEASE_STALE_S` is stale on any host (a node that died, a process killed by SIGKILL); one
whose owner is a dead process of this host is stale at once, and an empty one (its writer died
between creating and writing it) after `EMPTY_GRACE_S`. Either way the fallback is logged once
per process. Three rules keep two holders apart:

* a stale lease is taken over and the lock taken in the same try (a non-blocking acquire after
  a crash succeeds at once);
* a file is removed only if it is still the very file judged (`_remove_if_same`): it is first
  renamed aside under a name of this process (a rename is atomic, so of several processes one
  moves it), its inode, mtime and content are checked there, and a different file (a newer
  holder's lease, or the same lease renewed meanwhile) is put back;
* `release` removes the owner file only while it is this lock's own (the inode its descriptor
  holds and its token); a lease taken over meanwhile is left to its new holder, with a warning.

Why by hand and not filelock's `SoftFileLease` (filelock 4.3 is installed with torch): that
lease is taken over only after the contender itself has watched it unchanged for the whole
lease duration (its own monotonic clock; it never trusts the file's mtime). A job's lock is one
non-blocking try per launch, so a relaunch after its node died would be refused every time;
the lease here judges age by the shared filesystem's mtime, in one look.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.2
LEASE_REFRESH_S = 30.0  # the owner touches its owner file this often
LEASE_STALE_S = 4 * LEASE_REFRESH_S  # untouched this long: its owner is gone (any host)
EMPTY_GRACE_S = 10.0  # an empty owner file this old: its writer died before writing it
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a lock file that is a symbolic link is not opened
# Errors that say "not yours to open", unlike a filesystem where no file can be made at all.
_DENIED = (errno.EACCES, errno.EPERM, errno.ELOOP)
_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    """Log a warning the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _owner(text: str) -> tuple[str, str]:
    """(host, pid) of an owner line `host pid token` (`host pid` from before tokens)."""
    parts = text.split()
    return (parts[0], parts[1]) if len(parts) >= 2 else ("", "")


def _owner_is_dead(text: str) -> bool:
    """Whether an owner line names a process of this host that no longer runs."""
    host, pid = _owner(text)
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _stale_reason(seen: os.stat_result, text: str) -> str | None:
    """Why an owner file (its status `seen` and content `text`) no longer holds its lock
    (None: it does)."""
    age = time.time() - seen.st_mtime
    if not text.strip():
        return f"empty for {age:.0f} s" if age > EMPTY_GRACE_S else None
    if _owner_is_dead(text):
        return f"its owner ({text.strip()}) is gone"
    if age > LEASE_STALE_S:
        return f"its owner ({text.strip()}) has not renewed it for {age:.0f} s"
    return None


def _read(fd: int) -> str:
    return os.read(fd, 4096).decode(errors="replace")


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_mtime_ns)


def _remove_if_same(path: Path, seen: os.stat_result, text: str) -> bool | None:
    """Remove `path` if it is still the very file judged (status `seen`, content `text`): True
    removed, None already gone, False another file (left in place). See the module docstring."""
    aside = path.with_name(f"{path.name}.{secrets.token_hex(4)}.aside")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(aside, os.O_RDONLY | _NOFOLLOW)
        try:
            same = _same(os.fstat(fd), seen) and _read(fd) == text
        finally:
            os.close(fd)
    except OSError:
        same = False
    if same:
        aside.unlink(missing_ok=True)
        return True
    try:
        os.link(aside, path)  # put back, never over a file that appeared meanwhile
    except FileExistsError:
        log.warning("%s: a lease moved aside to be checked was replaced meanwhile", path)
    except OSError:  # no hard links on this filesystem
        if not path.exists():
            os.rename(aside, path)
    aside.unlink(missing_ok=True)
    return False


class FileLock:
    """An exclusive lock on `path` (created when missing). `acquire` returns whether it holds
    the lock: False when `blocking=False` and it is held (or its file cannot be opened:
    `denied`), when `timeout` seconds passed, or when no lock can be taken on this filesystem
    at all (`unavailable`, logged once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.owner_file = self.path.with_name(self.path.name + ".owner")
        self._handle: int | None = None  # the flocked descriptor
        self._lease: tuple[int, str] | None = None  # (descriptor, token) of our owner file
        self._renewing = threading.Event()
        self._renewer: threading.Thread | None = None
        self.unavailable = False  # set when no lock at all can be taken here
        self.denied: str | None = None  # a lock file that cannot be opened: why (held)

    @property
    def held(self) -> bool:
        return self._handle is not None or self._lease is not None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with contextlib.suppress(OSError):  # reported by the open below
            self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = self._try_once()
            if taken is not None:
                self.unavailable = not taken
                return taken
            if not blocking or (deadline is not None and time.monotonic() >= deadline):
                return False
            time.sleep(POLL_S)

    def _deny(self, path: Path, err: OSError) -> None:
        """A lock file this process may not open: counted as held, said once."""
        why = "a symbolic link" if err.errno == errno.ELOOP else os.strerror(err.errno or 0)
        self.denied = f"the lock file {path} cannot be opened ({why})"
        warn_once(
            f"denied:{path}",
            "%s: counted as held by another process; if none holds it, its owner can remove "
            "it, or use a folder of your own",
            self.denied,
        )

    def _open(self) -> int | bool | None:
        """A descriptor on the lock file; None: it cannot be opened (held); False: no file can
        be made here at all (a missing or read-only folder)."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o666)
        except OSError as err:
            first = err
        if first.errno in _DENIED or first.errno == errno.EROFS:
            try:  # another user's lock file (or a read-only filesystem): flock reads suffice
                return os.open(self.path, os.O_RDONLY | _NOFOLLOW)
            except OSError as err:
                if err.errno in _DENIED or first.errno in _DENIED:
                    self._deny(self.path, err if err.errno in _DENIED else first)
                    return None
        warn_once(f"open:{self.path.parent}", "no lock can be taken under %s (%s)",
                  self.path.parent, first)  # fmt: skip
        return False

    def _try_once(self) -> bool | None:
        """True: taken; None: held by another (try again); False: cannot lock here."""
        fd = self._open()
        if fd is None or fd is False:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as err:  # ENOLCK, EOPNOTSUPP, ...: the filesystem does not do flock
            os.close(fd)
            warn_once(
                f"flock:{self.path.parent}",
                "flock is not supported under %s (%s): locking with atomically created files "
                "instead",
                self.path.parent,
                os.strerror(err.errno),
            )
            return self._try_owner_file()
        self._handle = fd
        return True

    def _try_owner_file(self) -> bool | None:
        for _ in range(2):  # a stale lease taken over is taken in this very try
            try:
                fd = os.open(self.owner_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY | _NOFOLLOW,
                             0o666)  # fmt: skip
            except FileExistsError:
                if not self._take_over_if_stale():
                    return None
                continue
            except OSError as err:
                if err.errno in _DENIED:
                    self._deny(self.owner_file, err)
                    return None
                warn_once(f"excl:{self.path.parent}", "no lock can be taken under %s (%s)",
                          self.path.parent, err)  # fmt: skip
                return False
            token = secrets.token_hex(8)
            os.write(fd, f"{socket.gethostname()} {os.getpid()} {token}\n".encode())
            self._lease = (fd, token)
            self._renewing = threading.Event()
            self._renewer = threading.Thread(
                target=self._renew, args=(self._renewing, fd), daemon=True
            )
            self._renewer.start()
            return True
        return None

    def _take_over_if_stale(self) -> bool:
        """Remove the owner file when its lease is stale; whether the name may be free now."""
        try:
            fd = os.open(self.owner_file, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return True  # released meanwhile
        except OSError as err:
            self._deny(self.owner_file, err)
            return False
        try:
            seen, text = os.fstat(fd), _read(fd)
        finally:
            os.close(fd)
        why = _stale_reason(seen, text)
        if not why:
            return False
        removed = _remove_if_same(self.owner_file, seen, text)
        if removed:
            log.warning("%s: %s; taken over", self.owner_file, why)
        return removed is not False

    def _renew(self, stop: threading.Event, fd: int) -> None:
        """Keep the lease: touch the owner file, through its own descriptor (a file that has
        taken its name meanwhile is another holder's and is never touched), until released."""
        while not stop.wait(LEASE_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(fd)

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            os.close(self._handle)
            self._handle = None
        if self._lease is None:
            return
        (fd, token), self._lease = self._lease, None
        self._renewing.set()
        if self._renewer is not None:  # no touch may land between the check and the removal
            self._renewer.join(timeout=5)
        try:
            text = _text_of(self.owner_file)
            mine = token in text and _is_file_of(self.owner_file, fd)
            if not (mine and _remove_if_same(self.owner_file, os.fstat(fd), text)):
                log.warning(
                    "%s: this process's lease was taken over by another (it was not renewed "
                    "for %.0f s); left to its new holder",
                    self.owner_file,
                    LEASE_STALE_S,
                )
        finally:
            os.close(fd)


def _is_file_of(path: Path, fd: int) -> bool:
    """Whether `path` names the file open as `fd`."""
    try:
        return os.path.samestat(os.lstat(path), os.fstat(fd))
    except OSError:
        return False


def _text_of(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return ""
    try:
        return _read(fd)
    finally:
        os.close(fd)
