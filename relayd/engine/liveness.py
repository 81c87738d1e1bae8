"""Proof of life: an exclusive lock on a file in the service's runtime directory, which the
operating system releases when the process that holds it dies, and with it every socket the
process had. A relay takes the first free slot (`relayd-<slot>.lock`) and puts its identity
into every owner token it claims with; a relay that later takes the same slot knows that
every lease carrying that identity belongs to a dead process, and takes those leases back
at once instead of waiting out `relay.lease_s` (docs/contract.md, C4).

The identity is the host's boot id and the lock file's device and inode: unique per host
and per file, so two relays on one host (two slots, or two runtime directories: two
containers' tmpfs mounts) never share one, and a relay on another host (another boot id)
never takes a lease of this one's. Without a runtime directory, a boot id, or a file system
that locks, there is no proof: relayd waits out the leases of a dead process, as it always
did, and `relayd check` says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from relayd.engine.claim import HOLDER_BYTES

# systemd's RuntimeDirectory= (set by the unit); `relay.runtime_dir` names another.
RUNTIME_DIRECTORY_ENV = "RUNTIME_DIRECTORY"
# Where Linux tells the current boot apart from every other, on any host.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# The relays of one runtime directory: as many as may run at once there.
SLOTS = 64
_NO_DIRECTORY = "no runtime directory (relay.runtime_dir, or systemd's RuntimeDirectory=)"


@dataclass(frozen=True, slots=True)
class Proof:
    """The lock of one slot, held for the life of the process."""

    path: Path
    slot: int
    identity: str  # boot id, device, inode
    holder: bytes  # the identity's digest: the first bytes of every owner token
    fd: int  # the locked file's descriptor: the lock lasts while it is open

    def release(self) -> None:
        """Give the slot up (a clean stop, once nothing more is sent): its next holder then
        takes back the leases this process left, if any."""
        with contextlib.suppress(OSError):
            os.close(self.fd)

    @property
    def leases(self) -> tuple[uuid.UUID, uuid.UUID]:
        """The lowest and highest owner token carrying this identity."""
        return (
            uuid.UUID(bytes=self.holder + bytes(16 - HOLDER_BYTES)),
            uuid.UUID(bytes=self.holder + b"\xff" * (16 - HOLDER_BYTES)),
        )


@dataclass(frozen=True, slots=True)
class NoProof:
    """Why this process holds no proof of life (a dead relay's leases then expire)."""

    reason: str


def runtime_dir(configured: Path | None, environ: Mapping[str, str]) -> Path | None:
    """`relay.runtime_dir`, else systemd's `$RUNTIME_DIRECTORY` (its first directory)."""
    if configured is not None:
        return configured
    named = environ.get(RUNTIME_DIRECTORY_ENV, "").split(":")[0]
    return Path(named) if named else None


def acquire(directory: Path | None, *, boot_id: Path = BOOT_ID) -> Proof | NoProof:
    """Lock the first free slot of `directory`; the lock lasts until `Proof.release`, or
    the process's end. `NoProof` saying why when there can be none."""
    if directory is None:
        return NoProof(_NO_DIRECTORY)
    boot = _boot_id(boot_id)
    if isinstance(boot, NoProof):
        return boot
    for slot in range(SLOTS):
        path = directory / f"relayd-{slot}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            return NoProof(f"cannot open a lock file in {directory}: {exc.strerror}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live relay holds this slot
        except OSError as exc:
            os.close(fd)
            return NoProof(f"{directory} does not lock files ({exc.strerror})")
        info = os.fstat(fd)
        identity = f"{boot}:{info.st_dev}:{info.st_ino}"
        holder = hashlib.sha256(identity.encode()).digest()[:HOLDER_BYTES]
        return Proof(path=path, slot=slot, identity=identity, holder=holder, fd=fd)
    return NoProof(f"every one of the {SLOTS} slots of {directory} is held by a live relay")


def probe(directory: Path | None, *, boot_id: Path = BOOT_ID) -> str | NoProof:
    """What `acquire` would find, without holding a slot (`relayd check`): the directory, or
    why there would be no proof."""
    if directory is None:
        return NoProof(_NO_DIRECTORY)
    boot = _boot_id(boot_id)
    if isinstance(boot, NoProof):
        return boot
    path = directory / ".relayd-check.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        return NoProof(f"cannot open a lock file in {directory}: {exc.strerror}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another check holds it: the file system locks
    except OSError as exc:
        return NoProof(f"{directory} does not lock files ({exc.strerror})")
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
    return str(directory)


def _boot_id(path: Path) -> str | NoProof:
    try:
        boot = path.read_text().strip()
    except OSError as exc:
        return NoProof(f"no boot id to tell this host's processes apart ({exc.strerror})")
    if not boot:
        return NoProof(f"no boot id to tell this host's processes apart ({path} is empty)")
    return boot
