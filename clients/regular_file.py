"""Open a file to read only if it is a regular file.

A FIFO named as a trace or a journal blocks ``open`` until a writer comes (forever, as a
rule), and ``/dev/zero`` never ends: neither is a file a reader can finish. The file is
opened without blocking (O_NONBLOCK: a FIFO opens at once) and checked with fstat, so the
check is on the file actually read, not on a name that may change between a stat and the
open. Here, not in ``broker``, because the client library reads captures too and must not
import the broker; the broker's readers use it as well.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISLNK, "a symbolic link"),
)


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO (named pipe)", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str, mode: int) -> OSError:
    """The error of a file that is no regular file: an OSError, so that every reader's
    existing ``except OSError`` says it (its strerror is the reason)."""
    return OSError(errno.EINVAL, f"{kind_of(mode)}, not a regular file", path)


def open_regular(path: str) -> BinaryIO:
    """``open(path, "rb")``, refusing (OSError) anything but a regular file (symbolic links
    to one are followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
