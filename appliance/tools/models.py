"""Where models come from (the read-only models directory) and what GPU budget a run has."""

from __future__ import annotations

import json
import os
from typing import Any

# Written by the server into the run's working directory when the run was granted a GPU.
from appliance.jail.channel import GRANT_FILE

MODELS_ENV = "SANDBOX_MODELS_DIR"


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
        raise ModelError(f"model path {raw!r} is outside the models directory ({root}); "
                         f"models load only from there")
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
