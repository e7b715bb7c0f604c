"""open_regular opens a regular file (through a symbolic link too) and refuses a FIFO, a
folder or a device at once, without blocking on the FIFO."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clients.regular_file import open_regular


def test_a_regular_file_and_a_link_to_one_open(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"data")
    link = tmp_path / "link"
    link.symlink_to(path)
    for name in (path, link):
        with open_regular(str(name)) as f:
            assert f.read() == b"data"


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_what_is_no_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    if kind == "fifo":
        path = str(tmp_path / "pipe")
        os.mkfifo(path)
        words = "FIFO"
    elif kind == "folder":
        path, words = str(tmp_path), "folder"
    else:
        path, words = "/dev/null", "character device"  # only read: nothing is written to /dev
    with pytest.raises(OSError) as caught:
        open_regular(path)
    assert caught.value.strerror == f"a {words}{' (named pipe)' if kind == 'fifo' else ''}, not a regular file"
    assert caught.value.filename == path


def test_a_missing_file_is_the_usual_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_regular(str(tmp_path / "none"))
