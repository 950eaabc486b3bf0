from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Server, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real appliance with a small warm pool and no preload (fast)."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture
def fresh_tmp(tmp_path: Path) -> Path:
    return tmp_path
