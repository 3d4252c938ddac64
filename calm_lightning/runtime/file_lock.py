"""Exclusive locks between processes through a file, also where `flock` is not supported.

`flock` is the first choice: the kernel releases it when its holder dies. Some shared
filesystems refuse it (Lustre mounted with `noflock`, some NFS setups: ENOLCK, EOPNOTSUPP,
ENOSYS, EINVAL: any error but "held by another"); there the lock is a second file created
atomically (`O_CREAT | O_EXCL`) holding its owner's host and pid, removed on release. Such a
file outlives a crashed holder, so it is a lease: its owner touches it every `LEASE_REFRESH_S`
(a daemon thread), and a file not touched for `LEASE_STALE_S` is stale on any host (a node
that died, a process killed by SIGKILL); one whose owner is a dead process of this host is
stale at once, and an empty one (its writer died between creating and writing it) after
`EMPTY_GRACE_S`. A stale file is taken over. Either way the fallback is logged once per
process.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

POLL_S = 0.2
LEASE_REFRESH_S = 30.0  # the owner touches its owner file this often
LEASE_STALE_S = 4 * LEASE_REFRESH_S  # untouched this long: its owner is gone (any host)
EMPTY_GRACE_S = 10.0  # an empty owner file this old: its writer died before writing it
_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    """Log a warning the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _owner_is_dead(text: str) -> bool:
    """Whether an owner line `host pid` names a process of this host that no longer runs."""
    host, _, pid = text.strip().rpartition(" ")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _stale_reason(owner_file: Path, text: str) -> str | None:
    """Why an owner file no longer holds its lock (None: it does)."""
    try:
        age = time.time() - owner_file.stat().st_mtime
    except FileNotFoundError:
        return None  # released meanwhile: the next try takes it
    if not text.strip():
        return f"empty for {age:.0f} s" if age > EMPTY_GRACE_S else None
    if _owner_is_dead(text):
        return f"its owner ({text.strip()}) is gone"
    if age > LEASE_STALE_S:
        return f"its owner ({text.strip()}) has not renewed it for {age:.0f} s"
    return None


class FileLock:
    """An exclusive lock on `path` (created when missing). `acquire` returns whether it holds
    the lock: False when `blocking=False` and it is held, when `timeout` seconds passed, or when
    no lock can be taken on this filesystem at all (logged once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.owner_file = self.path.with_name(self.path.name + ".owner")
        self._handle = None
        self._owns_file = False
        self.unavailable = False  # set when no lock at all can be taken here

    @property
    def held(self) -> bool:
        return self._handle is not None or self._owns_file

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

    def _try_once(self) -> bool | None:
        """True: taken; None: held by another (try again); False: cannot lock here."""
        try:
            handle = open(self.path, "a")  # noqa: SIM115 (kept open while the lock is held)
        except OSError as err:  # a read-only or missing folder: no lock of either kind
            warn_once(f"open:{self.path.parent}", "no lock can be taken under %s (%s)",
                      self.path.parent, err)  # fmt: skip
            return False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return None
        except OSError as err:  # ENOLCK, EOPNOTSUPP, ...: the filesystem does not do flock
            handle.close()
            warn_once(
                f"flock:{self.path.parent}",
                "flock is not supported under %s (%s): locking with atomically created files "
                "instead",
                self.path.parent,
                os.strerror(err.errno),
            )
            return self._try_owner_file()
        self._handle = handle
        return True

    def _try_owner_file(self) -> bool | None:
        try:
            fd = os.open(self.owner_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            try:
                owner = self.owner_file.read_text()
            except FileNotFoundError:  # released meanwhile
                return None
            why = _stale_reason(self.owner_file, owner)
            if why:
                log.warning("%s: %s; taken over", self.owner_file, why)
                self.owner_file.unlink(missing_ok=True)
            return None
        except OSError as err:
            warn_once(
                f"excl:{self.path.parent}",
                "no lock can be taken under %s (%s)",
                self.path.parent,
                err,
            )
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{socket.gethostname()} {os.getpid()}\n")
        self._owns_file = True
        self._renewing = threading.Event()
        threading.Thread(target=self._renew, args=(self._renewing,), daemon=True).start()
        return True

    def _renew(self, stop: threading.Event) -> None:
        """Keep the lease: touch the owner file until released."""
        while not stop.wait(LEASE_REFRESH_S):
            with contextlib.suppress(OSError):
                os.utime(self.owner_file)

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
        if self._owns_file:
            self._renewing.set()
            self.owner_file.unlink(missing_ok=True)
            self._owns_file = False
