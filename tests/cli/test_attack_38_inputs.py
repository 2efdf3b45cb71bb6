"""Round 5's untyped inputs: each one a typed error with one clear line, never exit 3.

Tier URLs (``--shared`` and ``PERSIST_SHARED``) with a bad IPv6 host, a port out of
range or not a number; ``persist config set max-bytes`` with 400 digits; an S3
failure that printed obstore's ~40-line internal error structure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import persist
from bench.servers import free_port
from tests.helpers import persist_cli

BAD_URLS = [
    "redis://[::1",
    "redis://[zz::1]:6379",
    "redis://localhost:99999",
    "redis://localhost:abc",
    "redis://localhost:-1",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_shared_tier_url_is_a_typed_error(tmp_path: Path, url: str) -> None:
    for out in (
        persist_cli(tmp_path, "sync", "--shared", url, check=False),
        persist_cli(tmp_path, "sync", check=False, env={"PERSIST_SHARED": url}),
    ):
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and "bug in persist" not in out.stderr
        assert f"the shared tier URL {url!r} is not redis://host:port/db" in out.stderr


def test_a_bad_cluster_node_is_a_typed_error() -> None:
    from persist.errors import InvalidArgumentError
    from persist.remote.redis_cluster import cluster_client

    for url in ("redis+cluster://a:99999", "redis+cluster://a:0", "redis+cluster://a:²"):
        with pytest.raises(InvalidArgumentError, match="a port from 1 to 65535"):
            cluster_client(url, {})


def test_a_size_of_400_digits_is_refused(tmp_path: Path) -> None:
    persist.Store(tmp_path).close()
    out = persist_cli(tmp_path, "config", "set", "max-bytes", "9" * 400, check=False)
    assert out.returncode == 2, out.stderr
    assert "is larger than persist takes" in out.stderr and "Traceback" not in out.stderr
    exact = persist_cli(tmp_path, "config", "set", "max-bytes", "1.5G")
    assert "1.5 GiB" in exact.stdout


def test_an_s3_failure_is_one_line(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        "AWS_ENDPOINT_URL": down,
        "AWS_ALLOW_HTTP": "true",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
    }
    out = persist_cli(
        tmp_path, "sync", "--cold", "s3://bucket/p", "--pull", "chat", check=False, env=env
    )
    assert "Traceback" not in out.stderr
    failed = [line for line in out.stderr.splitlines() if "cold tier" in line]
    assert failed, out.stderr
    assert "Debug source" not in out.stderr and "RetryErrorImpl" not in out.stderr
    assert len(out.stderr.splitlines()) <= 4, out.stderr
