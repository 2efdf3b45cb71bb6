"""A real redis-server on 127.0.0.1, started per test with a bounded wait, stopped by its pid."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.tools import need

# docs/fleet.md's Redis ACL for a tenant: every command but the admin ones, the dangerous
# ones (FLUSHALL, KEYS, CONFIG, ...) and the two that read key names outside its pattern
RECIPE = ("+@all", "-@admin", "-@dangerous", "-scan", "-randomkey")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, tmp: Path, *extra: str) -> None:
        self.port, self.tmp, self.extra = free_port(), tmp, extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = need("redis-server")
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(self.tmp), *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class S3Server:
    """moto's S3 server mode on 127.0.0.1, with one bucket, and the AWS variables set."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.tmp = free_port(), tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.url = "s3://persist-test/fleet"

    def start(self) -> None:
        exe = shutil.which("moto_server")
        if exe is None:
            pytest.fail("moto_server is not installed (the test extra brings moto[server])")
        args = [exe, "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("moto_server did not listen within 20 s")
        self.client().create_bucket(Bucket="persist-test")

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def s3_down(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Stores opened inside reach S3 at a port nothing listens on (an outage)."""
    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        yield


@pytest.fixture
def s3_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    server = S3Server(tmp_path)
    for k, v in {
        "AWS_ENDPOINT_URL": server.endpoint,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RedisClusterServers:
    """Three redis-server masters on 127.0.0.1 joined into one Redis Cluster (all 16384
    slots) by ``redis-cli --cluster create``, with bounded waits; stopped by their pids."""

    def __init__(self, tmp: Path) -> None:
        self.nodes: list[RedisServer] = []
        for i in range(3):
            d = tmp / f"node{i}"
            d.mkdir()
            conf = ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf")]
            node = RedisServer(d, *conf, "--cluster-node-timeout", "2000")
            while node.port > 55000:  # its cluster bus listens on port + 10000
                node.port = free_port()
            node.url = f"redis://127.0.0.1:{node.port}/0"
            self.nodes.append(node)
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        self.url = f"redis+cluster://{hosts}"

    def start(self) -> None:
        cli = need("redis-cli")
        for n in self.nodes:
            n.start()
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [n.client().cluster("info") for n in self.nodes]
            if all(i.get("cluster_state") == "ok" for i in infos):
                return
            time.sleep(0.2)
        raise RuntimeError("the Redis cluster did not become ok within 30 s")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class Clock:
    """A tier's clock, stopped: the breaker's and the secret's time windows move only when
    a test says so (``advance``), however long the test takes."""

    def __init__(self, store: Any) -> None:
        self.now = time.monotonic()
        for tier in store.tiers:
            tier.tier.clock = self

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
