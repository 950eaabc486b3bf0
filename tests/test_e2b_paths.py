"""E2B's paths onto the jail's working directory (appliance.api.e2b.envd.paths); pure."""

from __future__ import annotations

import pytest

from appliance.api.e2b.envd.paths import BadPath, Target, resolve


@pytest.mark.parametrize(
    ("path", "parts", "root"),
    [
        ("", (), "/home/user"),
        ("~", (), "/home/user"),
        ("~/a/b", ("a", "b"), "/home/user"),
        ("a/./b/", ("a", "b"), "/home/user"),
        ("/home/user", (), "/home/user"),
        ("/home/user/../user/x", ("x",), "/home/user"),
        ("//home//user///x", ("x",), "/home/user"),
        ("/workspace/a", ("a",), "/workspace"),
        ("a/../../user/b", ("b",), "/home/user"),  # lexically /home/user/b
    ],
)
def test_paths_below_the_working_directory(path: str, parts: tuple[str, ...], root: str) -> None:
    assert resolve(path) == Target(parts, root)


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/etc/passwd",
        "/home",
        "/home/userx",
        "/home/user/../../etc",
        "../x",
        "/workspace/../etc",
        "/tmp",
        "a\x00b",
    ],
)
def test_anything_else_is_refused(path: str) -> None:
    with pytest.raises(BadPath):
        resolve(path)


def test_sizes_are_bounded() -> None:
    with pytest.raises(BadPath, match="deeper"):
        resolve("/".join(["d"] * 129))
    with pytest.raises(BadPath, match="longer than 255"):
        resolve("x" * 256)
    with pytest.raises(BadPath, match="4096"):
        resolve("a/" * 3000)
    assert len(resolve("/".join(["d"] * 128)).parts) == 128


def test_reported_paths_use_the_callers_name() -> None:
    t = resolve("/workspace/a")
    assert t.shown == "/workspace/a" and t.child("b/c") == "/workspace/a/b/c"
    assert resolve("a").child("b") == "/home/user/a/b"
