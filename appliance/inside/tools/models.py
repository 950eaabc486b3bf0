"""Where models come from (the read-only models directory) and what GPU budget a run has."""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from typing import Any, Generic, TypeVar

# Written by the server into the run's working directory when the run was granted a GPU.
from appliance.inside.channel import GRANT_FILE

MODELS_ENV = "SANDBOX_MODELS_DIR"
T = TypeVar("T")


class ModelError(Exception):
    """A model could not be found, is outside the models directory, or failed to load."""


def models_dir() -> str:
    """The models directory, or ModelError when the appliance has none."""
    root = os.environ.get(MODELS_ENV, "")
    if not root:
        raise ModelError(f"no models directory: the appliance runs without {MODELS_ENV}")
    return os.path.realpath(root)


def resolve_model(path: str | os.PathLike[str]) -> str:
    """The real path of a model file inside the models directory; ModelError otherwise.

    Relative paths are taken inside the models directory; links are resolved first, so
    a link (or `..`) that leads out of it is refused like any outside path.
    """
    root = models_dir()
    raw = os.fspath(path)
    if not raw or "\x00" in raw:
        raise ModelError("model path is empty or contains a NUL byte")
    candidate = os.path.realpath(raw if os.path.isabs(raw) else os.path.join(root, raw))
    if os.path.commonpath([candidate, root]) != root:
        raise ModelError(
            f"model path {raw!r} is outside the models directory ({root}); models load only from there"
        )
    if not os.path.isfile(candidate):
        raise ModelError(f"no model file {raw!r} in the models directory ({root})")
    return candidate


def gpu_grant() -> dict[str, Any] | None:
    """This run's GPU grant ({"index", "uuid", "memory_mb", ...}), or None on the CPU."""
    home = os.environ.get("HOME", "/workspace")
    try:
        with open(os.path.join(home, GRANT_FILE)) as fh:
            grant = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(grant, dict) or not isinstance(grant.get("memory_mb"), int):
        return None
    return grant


def threads() -> int:
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


class ModelCache(Generic[T]):
    """Loaded models of this process, one per model file: the same file with the same
    parameters is the loaded one; other parameters replace it (two copies of one model
    would hold its memory twice). A file changed on disk since is loaded again."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, T]] = {}
        self.loads = 0
        self.hits = 0

    def get(self, real: str, params: Any, load: Callable[[], T]) -> T:
        """The model at real path `real` loaded with `params`: held, or `load()`ed now."""
        st = os.stat(real)
        key = (st.st_mtime_ns, st.st_size, st.st_ino, params)
        held = self._held.get(real)
        if held is not None and held[0] == key:
            self.hits += 1
            return held[1]
        if self._held.pop(real, None) is not None:  # free the old one before loading its replacement
            del held
            gc.collect()  # bindings' models sit in reference cycles; their native memory goes with them
        model = load()
        self.loads += 1
        self._held[real] = (key, model)
        return model

    def info(self) -> dict[str, int]:
        """{"loads", "hits", "held"} so far."""
        return {"loads": self.loads, "hits": self.hits, "held": len(self._held)}
