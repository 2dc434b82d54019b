"""The embedded stack's own failure modes: a broken data directory, a taken port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from alma_core import errors
from alma_core.cli.embedded import EmbeddedStack, Redis


async def test_broken_data_directory_says_how_to_reset(tmp_path: Path) -> None:
    (tmp_path / "postgres").mkdir()
    (tmp_path / "postgres" / "stray.txt").write_text("not a database")
    stack = EmbeddedStack(tmp_path, kafka_bootstrap="127.0.0.1:9", redis_url="redis://x:1/0")
    with pytest.raises(errors.StackError, match="holds no PostgreSQL data") as info:
        await stack.start()
    assert "move it away or remove it" in info.value.message
    assert (tmp_path / "postgres" / "stray.txt").exists(), "nothing is deleted unasked"


async def test_a_taken_port_is_avoided_when_none_was_asked_for(tmp_path: Path) -> None:
    redis = Redis(tmp_path)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        taken = blocker.getsockname()[1]
        with pytest.raises(errors.StackError, match="did not start"):
            await redis.start(port=taken)  # asked for: a clear error
        await redis.start()  # not asked for: a free port is found
        try:
            assert redis.port != taken
            assert redis.running
        finally:
            await redis.stop()
