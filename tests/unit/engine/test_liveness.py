"""A relay's proof of life: the first free slot of its runtime directory, locked for as long
as the process lives; an identity unique per lock file and per boot, carried by every owner
token the process claims with; no proof, saying why, where there can be none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from relayd.engine.claim import owner_token
from relayd.engine.liveness import NoProof, Proof, acquire, probe, runtime_dir

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def boot_id(tmp_path: Path) -> Path:
    """A boot id of the test's own (the host's is the same for every test)."""
    path = tmp_path / "boot_id"
    path.write_text(f"{uuid.uuid4()}\n")
    return path


def _acquired(directory: Path, boot_id: Path) -> Proof:
    proof = acquire(directory, boot_id=boot_id)
    assert isinstance(proof, Proof), proof
    return proof


def test_relays_of_one_directory_take_slots_of_their_own(tmp_path: Path, boot_id: Path) -> None:
    """A second relay of the same directory takes the next slot, with another identity; a
    slot given up is taken again, with the identity it had."""
    first = _acquired(tmp_path, boot_id)
    second = _acquired(tmp_path, boot_id)
    try:
        assert (first.slot, second.slot) == (0, 1)
        assert first.holder != second.holder
        first.release()
        again = _acquired(tmp_path, boot_id)
        assert (again.slot, again.holder, again.identity) == (0, first.holder, first.identity)
        again.release()
    finally:
        second.release()


def test_another_directory_or_another_boot_is_another_identity(
    tmp_path: Path, boot_id: Path
) -> None:
    """Two runtime directories (two containers on one host) or two boots (two hosts, or the
    same host rebooted) never share an identity, even for the same slot."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    here = _acquired(tmp_path / "a", boot_id)
    there = _acquired(tmp_path / "b", boot_id)
    here.release()
    other_boot = tmp_path / "other_boot_id"
    other_boot.write_text(f"{uuid.uuid4()}\n")
    elsewhere = _acquired(tmp_path / "a", other_boot)
    try:
        assert (here.slot, there.slot, elsewhere.slot) == (0, 0, 0)
        assert len({here.holder, there.holder, elsewhere.holder}) == 3
    finally:
        there.release()
        elsewhere.release()


def test_owner_tokens_carry_the_identity(tmp_path: Path, boot_id: Path) -> None:
    """Every token of a holder lies in its leases' range, and no other's does: a successor
    takes back exactly the claims of its slot's dead process."""
    mine = _acquired(tmp_path, boot_id)
    other = _acquired(tmp_path, boot_id)
    try:
        lowest, highest = mine.leases
        assert all(lowest <= owner_token(mine.holder) <= highest for _ in range(100))
        assert not any(lowest <= owner_token(other.holder) <= highest for _ in range(100))
        assert owner_token(mine.holder) != owner_token(mine.holder)  # fresh per claim
        assert owner_token(None).version == 4  # without a proof: random, as ever
    finally:
        mine.release()
        other.release()


_HOLD = """
import sys, time
from pathlib import Path
from relayd.engine.liveness import acquire
proof = acquire(Path(sys.argv[1]), boot_id=Path(sys.argv[2]))
print(proof.slot, proof.identity, flush=True)
time.sleep(600)
"""


def test_a_killed_process_leaves_its_slot_and_identity_to_its_successor(
    tmp_path: Path, boot_id: Path
) -> None:
    """The operating system releases the lock of a process killed with SIGKILL: the next
    relay takes its slot, with its identity (and so its leases)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path), str(boot_id)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        slot, identity = child.stdout.readline().split()
        assert slot == "0"
        held = _acquired(tmp_path, boot_id)
        assert held.slot == 1  # the child lives: its slot is taken
        held.release()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    successor = _acquired(tmp_path, boot_id)
    try:
        assert (successor.slot, successor.identity) == (0, identity)
    finally:
        successor.release()


def test_without_a_directory_or_a_boot_id_there_is_no_proof(tmp_path: Path, boot_id: Path) -> None:
    """No runtime directory, a directory that cannot hold a lock file, or no boot id: no
    proof, and why (what `relayd check` prints)."""
    missing = acquire(None, boot_id=boot_id)
    assert isinstance(missing, NoProof)
    assert missing.reason.startswith("no runtime directory")
    gone = acquire(tmp_path / "absent", boot_id=boot_id)
    assert isinstance(gone, NoProof)
    assert gone.reason.startswith("cannot open a lock file in")
    unbooted = acquire(tmp_path, boot_id=tmp_path / "no_boot_id")
    assert isinstance(unbooted, NoProof)
    assert unbooted.reason.startswith("no boot id")
    assert probe(tmp_path, boot_id=boot_id) == str(tmp_path)
    assert isinstance(probe(None, boot_id=boot_id), NoProof)
    assert list(tmp_path.glob(".relayd-check*")) == []  # the probe holds and leaves nothing


def test_the_runtime_directory_is_the_setting_else_systemds(tmp_path: Path) -> None:
    """`relay.runtime_dir` wins; else the first directory of $RUNTIME_DIRECTORY; else none."""
    assert runtime_dir(tmp_path, {"RUNTIME_DIRECTORY": "/run/x"}) == tmp_path
    assert runtime_dir(None, {"RUNTIME_DIRECTORY": "/run/x:/run/y"}) == Path("/run/x")
    assert runtime_dir(None, {}) is None
