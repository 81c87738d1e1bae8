"""`relayd demo` that cannot run says so in one line and leaves no empty directory behind."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Self

import pytest

import relayd.demo
import relayd.testing.postgres


class _NoServer:
    """An embedded PostgreSQL that cannot start (the `demo` extra is missing)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir

    def start(self) -> Self:
        raise RuntimeError("the embedded PostgreSQL server needs the 'demo' extra")


def test_a_failed_demo_removes_its_empty_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's temporary directory goes when nothing in it explains the failure."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(relayd.testing.postgres, "EmbeddedPostgres", _NoServer)
    assert relayd.demo.run_demo(10) == 1
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == (
        "relayd: demo failed: the embedded PostgreSQL server needs the 'demo' extra\n"
    )
