"""Read a file that holds secrets of the server's own (a key, a CA): it must be a regular file,
not a link, owned by the server's user and readable by it alone, so that nobody who could
have planted or read it is trusted."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance.core.errors import ApplianceError, SettingsError

MAX_BYTES = 1 << 20


def read_private(path: Path, source: str, error: type[ApplianceError] = SettingsError) -> bytes:
    """The file's first MAX_BYTES; `error` (naming `source`, the setting) if it is missing, a
    link, someone else's, or open to anyone else (not chmod 600)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise error(f"{source}: cannot open {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise error(
                f"{source}: {path} must be a regular file of the server's own, readable by it alone (chmod 600)"
            )
        return f.read(MAX_BYTES)
