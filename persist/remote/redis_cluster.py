"""A Redis Cluster client from one URL that names any of its nodes.  No mlx."""

from __future__ import annotations

import re
from typing import Any

from ..errors import InvalidArgumentError
from .urls import shown_url

__all__ = ["cluster_client"]


def cluster_client(url: str, timeouts: dict[str, Any]) -> Any:
    """A RedisCluster from ``redis+cluster://[[user]:password@]host:port[,host:port...]``:
    any of the nodes is enough to learn the slot map; TLS with ``rediss+cluster``."""
    from urllib.parse import unquote

    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    scheme, rest = url.split("://", 1)
    auth, _, hosts = rest.rpartition("@")
    user, _, password = auth.partition(":") if auth else ("", "", "")
    nodes = []
    for h in hosts.rstrip("/").split(","):
        host, _, port = h.strip().rpartition(":")
        if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
            raise InvalidArgumentError(
                "a cluster node is host:port (a port from 1 to 65535), not "
                f"{h.rpartition('@')[2]!r} in {shown_url(url)!r}"
            )
        nodes.append(ClusterNode(host, int(port)))
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(user) or None,
        password=unquote(password) or None,
        ssl=scheme.startswith("rediss"),
        retry=Retry(NoBackoff(), 1),  # an outage costs about one timeout, not ten
        **timeouts,
    )
