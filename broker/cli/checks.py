"""Bad input said as one line that names the flag or field and the reason, exit 2.

Everything a verb can check before it starts work is checked here, before a broker logs its
first line or a sweep starts its processes: argparse's own errors (one line, not the usage
block), numbers out of range, files that are not there, folders that cannot be written,
addresses that do not parse or cannot be bound.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import stat
import sys
from collections.abc import Callable
from typing import NoReturn

from clients.regular_file import kind_of, open_regular


class BadInput(Exception):
    """A flag or field whose value cannot be used; main() says it as one line, exit 2."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr (``prog: reason (see prog --help)``) and
    exit 2, instead of the usage block: the rule every verb keeps."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: Callable[[str], float], what: str) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(_number(text, int, "an integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port in 1..65535 (a broker to reach)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port in 1..65535, got {text!r}")
    return text


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def check_bindable(host: str, port: int, host_field: str, port_field: str, what: str) -> None:
    """Fail unless ``host`` resolves and ``port`` can be bound on it (0: any free port): a
    port another program holds, or a name that is no address here, is said before the
    broker starts, not as its logs and a traceback."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BadInput(host_field, f"cannot resolve {host!r}: {exc.strerror}") from None
    reasons = []
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the servers bind (TIME_WAIT of an earlier run is no conflict).
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                reasons.append(exc)
                continue
        return  # one address that binds is enough (gRPC binds what it can of the list)
    first = reasons[0]
    why = "in use by another program" if first.errno == errno.EADDRINUSE else first.strerror
    raise BadInput(port_field, f"cannot {what} on {host}:{port}: {why}")


def check_readable(path: str, field: str) -> None:
    """The file exists, is a regular file (a FIFO would block its reader forever, a device
    such as /dev/zero never ends), and can be read."""
    try:
        with open_regular(path):
            pass
    except OSError as exc:
        raise BadInput(field, f"cannot read {path}: {exc.strerror or exc}") from None


def check_writable_file(path: str, field: str) -> None:
    """A file can be written at ``path``: its folder exists, and it is not a folder."""
    if os.path.isdir(path):
        raise BadInput(field, f"{path} is a folder; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadInput(field, f"folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise BadInput(field, f"folder {folder} is not writable")


def check_new_or_regular(path: str, field: str) -> None:
    """``path`` is free, or a regular file a writer may replace: never a device, FIFO,
    socket or symbolic link (lstat: the link itself), which a rename over it would swap
    for a file (as root, /dev/full became one)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BadInput(field, f"cannot check {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise BadInput(field, f"{path} exists and is {kind_of(mode)}; give a new path or a regular file to replace")


def check_writable_dir(path: str, field: str) -> None:
    """A folder that exists, or a new one in an existing writable folder. The rule of every
    output (``--csv``, ``--out``, ``demo --keep``): the folder that holds it must exist; a
    missing path of folders is a slip (as root, ``--plot /nonexistent/dir/x`` made all
    three), so only DIR itself is made."""
    folder = os.path.abspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise BadInput(field, f"{path} exists and is not a folder")
    parent = os.path.dirname(folder)
    if not os.path.isdir(folder) and not os.path.isdir(parent):
        raise BadInput(field, f"folder {parent} does not exist (only DIR itself is made)")
    target = folder if os.path.isdir(folder) else parent
    if not os.access(target, os.W_OK):
        raise BadInput(field, f"cannot write into {target}")


def check_keep_dir(path: str, journal: str) -> None:
    """`demo --keep DIR`: DIR, or a new folder in an existing writable one, that holds no
    journal yet. A second run would append to the first run's journal and replay both runs
    as one (a wrong table, said nowhere), so it is refused, not added to; and a mistyped
    parent is refused rather than made."""
    folder = os.path.abspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise BadInput("--keep", f"{path} exists and is not a folder")
    parent = os.path.dirname(folder)
    if not os.path.isdir(parent):
        raise BadInput("--keep", f"folder {parent} does not exist (only DIR itself is made)")
    if not os.access(folder if os.path.isdir(folder) else parent, os.W_OK):
        raise BadInput("--keep", f"cannot write into {folder if os.path.isdir(folder) else parent}")
    kept = os.path.join(folder, journal)
    if os.path.exists(kept):
        raise BadInput("--keep", f"{kept} is there from an earlier run; give a new folder, or remove it")


def say(verb: str, exc: BaseException) -> int:
    """One line on stderr for ``exc`` under ``verb``; returns 2, the bad-input exit code."""
    print(f"kvbroker {verb}: {exc}", file=sys.stderr)
    return 2
