"""What `kvbroker serve` checks before it starts: the mistakes a person makes in a config or
on the command line, said as one line naming the flag (or the config key, when the value
came from the file), before the broker logs anything. The broker checks the same things
again as it starts (a port can be taken in between); this is for the message."""

from __future__ import annotations

import os

from broker.cli.checks import BadInput, check_bindable, split_host_port
from broker.config import BrokerConfig, ConfigError
from broker.config.settings import check_listen
from broker.journal import JournalError, file_path, is_file_url, split_redis_url, unknown_scheme
from broker.journal.cluster import check_one_slot
from broker.journal.file import lock_path, release_lock, take_lock
from broker.journal.lease import check_free
from broker.journal.records import MAGIC
from broker.journal.redis_stream import stream_exists
from broker.journal.redis_urls import cluster_nodes, is_cluster_url, is_redis_url
from clients.regular_file import open_regular


def preflight(config: BrokerConfig, *, listen_flag: bool, journal_flag: bool, metrics_flags: bool) -> None:
    """Raise BadInput for the first thing that would keep the broker from starting."""
    listen = "--listen" if listen_flag else "broker.listen"
    try:
        check_listen(config.listen, listen)
    except ConfigError as exc:
        raise BadInput(listen, str(exc).split(": ", 1)[1]) from None
    host, port = split_host_port(config.listen)
    check_bindable(host, port, listen, listen, "listen")

    telemetry = config.telemetry
    if telemetry.prometheus_port:
        check_bindable(
            telemetry.prometheus_host,
            telemetry.prometheus_port,
            "--metrics-host" if metrics_flags else "telemetry.prometheus_host",
            "--metrics-port" if metrics_flags else "telemetry.prometheus_port",
            "serve /metrics",
        )
    check_journal(config, "--journal" if journal_flag else "journal.url")


def check_journal(config: BrokerConfig, field: str) -> None:
    url = config.journal.url
    if url == "none":
        return
    if is_redis_url(url):
        try:
            conn, named = split_redis_url(url)
            if is_cluster_url(url):
                cluster_nodes(conn)
        except (JournalError, ValueError) as exc:
            raise BadInput(field, str(exc)) from None
        if is_cluster_url(url):
            check_one_slot(config.stream_key())  # a JournalError of journal.stream, said by main() as the broker says it
        if config.journal.recover:
            # The broker reads its journal back at start: without Redis it cannot.
            try:
                stream_exists(conn, "kvbroker:preflight")
            except JournalError as exc:
                raise BadInput(
                    field, f"{exc} (the broker reads its journal back at start: start Redis, or set journal.recover = false)"
                ) from None
        if config.journal.lease_s:
            try:
                check_free(conn, named or config.stream_key())  # one writer per stream (broker.journal.lease)
            except JournalError as exc:
                raise BadInput(field, str(exc)) from None
        return
    if not is_file_url(url):
        raise BadInput(field, unknown_scheme(url))
    path = file_path(url)
    if os.path.isdir(path):
        raise BadInput(field, f"{path} is a folder; give the journal's file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadInput(field, f"folder {folder} does not exist")
    try:
        with open_regular(path) as f:  # a FIFO would block the start forever
            head = f.read(len(MAGIC))
    except FileNotFoundError:
        return  # a new journal
    except OSError as exc:
        raise BadInput(field, f"cannot read {path}: {exc.strerror or exc}") from None
    if head and not MAGIC.startswith(head):  # a torn header is the broker's to repair
        raise BadInput(field, f"{path} is not a kvbroker journal (it does not start with the journal header); give a new path")
    if os.path.exists(lock_path(path)):
        try:
            release_lock(path, take_lock(path))  # free (a crashed holder's): let go at once, the broker takes it as it starts
        except JournalError as exc:  # another broker writes this journal
            raise BadInput(field, str(exc)) from None
