"""Redis journal URLs, and the redis-py client each one needs.

``redis://HOST:PORT/DB``, ``rediss://`` (TLS) and ``unix://`` name one Redis server;
``redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` over
TLS) names a Redis Cluster by one or more of its nodes, reached through redis-py's cluster
client: it learns the slot map from any node it is given and follows it (MOVED, failovers).
A cluster has database 0 only. Any of them may carry ``?stream=KEY`` for readers.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from broker.journal.records import JournalError

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def is_redis_url(url: str) -> bool:
    return url.startswith(REDIS_SCHEMES + CLUSTER_SCHEMES)


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def cluster_nodes(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(a ``redis://`` or ``rediss://`` URL of the first node with the credentials and
    options, every node as (host, port)) of a cluster URL; raises JournalError naming what
    is wrong."""
    scheme, _, rest = url.partition("://")
    plain = scheme.replace("+cluster", "")
    parts = urlsplit(f"{plain}://{rest}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise JournalError(f"{redact_url(url)}: expected HOST:PORT[,HOST:PORT...] after {scheme}://, got {item.strip()!r}")
        nodes.append((host.strip("[]"), int(port)))
    if parts.path not in ("", "/", "/0"):
        raise JournalError(f"{redact_url(url)}: a Redis Cluster has database 0 only, got {parts.path!r}")
    first = f"{plain}://{userinfo + '@' if userinfo else ''}{nodes[0][0]}:{nodes[0][1]}/0"
    return first + (f"?{parts.query}" if parts.query else ""), nodes


def sync_client(url: str, **options: Any) -> redis.Redis | RedisCluster:
    """A blocking client of ``url`` (its ``?stream=`` already removed): a RedisCluster for a
    cluster URL, else a Redis."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    first, nodes = cluster_nodes(url)
    others = [ClusterNode(host, port) for host, port in nodes[1:]]
    return RedisCluster.from_url(first, startup_nodes=others, **options)


def redact_url(url: str) -> str:
    """The URL without its password, for logs and status."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
