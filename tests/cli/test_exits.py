"""Exit codes mean what they say: 1 persist refused, 3 a bug, 130 Ctrl-C, 0 on a closed pipe.

Inputs round 5's attack found untyped (exit 3) are typed errors of one clear line:
tier URLs (``--shared`` and ``PERSIST_SHARED``) with a bad IPv6 host, a port out
of range or not a number; ``persist config set max-bytes`` with 400 digits (it was
exit 2); an S3 failure that printed obstore's ~40-line internal error structure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from mlx_lm.models import cache as mc

import persist
from bench.servers import free_port
from persist.cli import cli
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import ROOT, persist_cli


def made(tmp_path: Path) -> str:
    """An empty store: only commands that write sessions make one."""
    persist.Store(tmp_path / "s").close()
    return str(tmp_path / "s")


def test_a_bug_is_exit_3_with_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("an unexpected bug")

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", broken)
    res = CliRunner().invoke(cli, ["ls", "--all", "--store", made(tmp_path)])
    assert res.exit_code == 3
    assert "Traceback" in res.output and "please report it" in res.output


@pytest.mark.parametrize("error", [ValueError("a bad value inside"), OSError(5, "EIO inside")])
def test_builtin_errors_are_bugs_not_user_errors(
    error: Exception, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Only PersistError is exit 1: a ValueError or OSError escaping persist is a bug."""

    def broken(*_: Any, **__: Any) -> Any:
        raise error

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", broken)
    res = CliRunner().invoke(cli, ["ls", "--store", made(tmp_path)])
    assert res.exit_code == 3 and "please report it" in res.output


def test_what_the_system_refuses_is_exit_1(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("a file, not a folder")
    f = str(tmp_path / "f")  # import makes its store: here it cannot
    res = CliRunner().invoke(cli, ["import", f, "--store", str(tmp_path / "f" / "s")])
    assert res.exit_code == 1 and "cannot open the store" in res.output


def test_ctrl_c_is_exit_130(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    from persist.storage import listing

    monkeypatch.setattr(listing, "stream", interrupted)
    res = CliRunner().invoke(cli, ["ls", "--store", made(tmp_path)])
    assert res.exit_code == 130


def test_a_persist_error_is_exit_1(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["show", "nope", "--store", made(tmp_path)])
    assert res.exit_code == 1 and "no session 'nope'" in res.output


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    root = tmp_path / "s"
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, 20))
    with persist.Store(root) as s:
        s.index.db.execute("PRAGMA synchronous=OFF")  # build speed only (3,000 commits)
        for i in range(3000):
            s.save([c], [i % 50] * 20, identity=IDENTITY, session=f"session-{i:05d}")
    p = subprocess.Popen(
        [sys.executable, "-m", "persist", "ls", "--store", str(root)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.readline()
    p.stdout.close()  # like `| head -1`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err, err


BAD_URLS = [
    "redis://[::1",
    "redis://[zz::1]:6379",
    "redis://localhost:99999",
    "redis://localhost:abc",
    "redis://localhost:-1",
    "redis://localhost:0/",  # taken, and then every connection failed
    "redis://localhost/x",  # taken as database 0
    "redis://localhost:6379/1/2",  # taken as database 12
    "redis://localhost:6379/0?foo=bar",  # TypeError inside redis-py
    "redis://localhost:6379/0?decode_responses=yes",  # every value a str
    "redis://localhost:6379/0?socket_timeout=600",  # past persist's stall bound
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_shared_tier_url_is_a_typed_error(tmp_path: Path, url: str) -> None:
    from persist.remote.urls import shown_url

    for out in (
        persist_cli(tmp_path, "sync", "--shared", url, check=False),
        persist_cli(tmp_path, "sync", check=False, env={"PERSIST_SHARED": url}),
    ):
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr and "bug in persist" not in out.stderr
        # a query is shown as ?*** (it may carry ?password=): remote/urls.shown_url
        assert f"the shared tier URL {shown_url(url)!r} is not redis://host:port/db" in out.stderr


def test_a_bad_cluster_node_is_a_typed_error() -> None:
    from persist.errors import InvalidArgumentError
    from persist.remote.redis_cluster import cluster_client

    for url in ("redis+cluster://a:99999", "redis+cluster://a:0", "redis+cluster://a:²"):
        with pytest.raises(InvalidArgumentError, match="a port from 1 to 65535"):
            cluster_client(url, {})


LARGEST = "at most 9,223,372,036,854,775,807 bytes (8E less one byte)"


@pytest.mark.parametrize("size", ["9" * 400, "8E", "8192P"])
def test_a_size_past_the_largest_is_a_typed_error_naming_it(tmp_path: Path, size: str) -> None:
    """400 digits were a usage error (exit 2), and 8E was refused as "at most 8E"."""
    persist.Store(tmp_path).close()
    out = persist_cli(tmp_path, "config", "set", "max-bytes", size, check=False)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"is larger than persist takes: {LARGEST}" in out.stderr


@pytest.mark.parametrize("size, shown", [("1.5G", "1.5 GiB"), ("2P", "2.0 PiB"), ("7E", "7.0 EiB")])
def test_sizes_up_to_the_largest_are_taken(tmp_path: Path, size: str, shown: str) -> None:
    persist.Store(tmp_path).close()
    out = persist_cli(tmp_path, "config", "set", "max-bytes", size)
    assert f"max-bytes: budget {shown} " in out.stdout


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


@pytest.mark.parametrize("source", ["/dev/zero", "big"])
def test_a_tier_key_file_is_read_with_a_bound(tmp_path: Path, source: str) -> None:
    path = source
    if source == "big":
        big = tmp_path / "big.key"
        big.write_bytes(b"ab" * (4 << 20))  # hex, 8 MiB
        path = str(big)
    out = persist_cli(tmp_path, "sync", "--tier-key-file", path, check=False)
    assert out.returncode == 1, out.stderr
    # a device is refused unread (round 5: a FIFO waited forever); a regular file by size
    want = "not a regular file" if source == "/dev/zero" else "is too long"
    assert want in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["", "x" * 100_000], ids=["empty", "100k"])
def test_a_pulled_name_is_checked_as_every_command_checks_it(tmp_path: Path, name: str) -> None:
    out = persist_cli(  # the name is refused before any tier is asked
        tmp_path, "sync", "--shared", "redis://127.0.0.1:1/0", "--pull", name, check=False
    )
    assert out.returncode == 1, out.stderr
    assert "session must be 1 to 1024 characters" in out.stderr


def test_the_errors_the_docs_name_are_persist_s() -> None:
    import persist

    for name in ("SessionUnreachableError", "AccessDeniedError", "HostCacheFullError",
                 "StoreNotFoundError"):  # fmt: skip
        assert issubclass(getattr(persist, name), persist.PersistError)
