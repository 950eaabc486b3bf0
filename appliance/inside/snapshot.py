"""A session's state as one archive, made and read inside its jail (never by the server).

`save` writes ARCHIVE in the cwd (/workspace): an uncompressed tar holding

- `workspace/...`: the cwd's directories and regular files (links and special files are
  skipped, and said so);
- `state.json`: the format, the names of the globals kept, what was skipped and why, and the
  sys.path entries `%pip install` added (`appliance.inside.magics`);
- `globals.pkl`: the interpreter's globals that pickle, as one cloudpickle dict: functions and
  classes defined in cells come by value, modules by name (imported again on restore).

The server copies that file out byte for byte and back into a new jail's cwd; `restore` reads
it there and unlinks it. Everything in it is untrusted, so it is parsed only here, as the jail's
uid: its members are written one directory at a time relative to descriptors, never following
a link, and a path that would leave the cwd is refused.

Standard library only, but cloudpickle, imported when a snapshot is asked for: it must be
installed for the jail's Python (SANDBOX_PYTHON; the appliance depends on it).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import stat
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from appliance.inside import channel

ARCHIVE = channel.SNAPSHOT_ARCHIVE
# Files of the cwd the server writes for each jail (a GPU run's grant): never kept, never restored.
SERVERS = frozenset((ARCHIVE, channel.GRANT_FILE))
FORMAT = 1
MAX_SKIPPED = 1000  # names a report lists; the count says how many more there were
MAX_REASON = 200
MAX_STATE_BYTES = 4 * 1024 * 1024
# The driver's own names in the namespace: remade by the driver in the new jail, never kept.
DRIVER_NAMES = frozenset(("__builtins__", "__name__", "__appliance_magics__"))


class _Discard(io.RawIOBase):
    """Where a trial pickle goes: only whether it pickles matters, not its bytes."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        # Large buffers come as they are (a PickleBuffer under protocol 5): count their bytes.
        with memoryview(b) as view:
            return view.nbytes


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        raise RuntimeError(
            "cloudpickle is not installed for the jail's Python (SANDBOX_PYTHON): snapshots need it"
        ) from None
    return cloudpickle


def _why(exc: BaseException) -> str:
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 (a user exception's __str__ may raise anything)
        text = type(exc).__name__
    return text if len(text) <= MAX_REASON else text[:MAX_REASON] + "…"


def _pickler(cloudpickle: Any, out: Any, namespace: dict[str, Any], kept: dict[str, Any]) -> Any:
    class Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            # cloudpickle would keep a copy of a readable file's contents in its place: a
            # different object, silently. An open file is skipped, and said so, like a socket.
            if isinstance(obj, io.IOBase):
                raise TypeError(f"cannot pickle an open file ({type(obj).__name__}); open it again after")
            return super().reducer_override(obj)

    pickler = Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    # Functions defined in cells have the namespace as their globals: cloudpickle pickles a
    # copy of the names they use, a dict of its own. Seeded with the dict being saved, that
    # copy is the same object, so once restored the functions' globals are the new namespace
    # itself (a later cell's `x = 2` is what they see), as they were here.
    refs = getattr(pickler, "globals_ref", None)
    if isinstance(refs, dict):
        refs[id(namespace)] = kept
    return pickler


def save(namespace: dict[str, Any], extra_paths: list[str]) -> dict[str, Any]:
    """Write ARCHIVE in the cwd; the report: {"globals": n, "skipped": [...], "bytes": n}.
    The archive, and the pickle on its way into it, are files of the jail: each is bounded by
    the jail's file size limit (SANDBOX_MAX_FILE_MB) and its disk quota."""
    try:
        return _save(namespace, extra_paths)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(ARCHIVE)
        if exc.errno == errno.EFBIG:
            raise OSError(
                exc.errno, "the snapshot is larger than one file of the jail may be (SANDBOX_MAX_FILE_MB)"
            ) from None
        if exc.errno == errno.ENOSPC:
            raise OSError(
                exc.errno, "the snapshot does not fit in the jail's disk quota (SANDBOX_MAX_DISK_MB)"
            ) from None
        raise


def _save(namespace: dict[str, Any], extra_paths: list[str]) -> dict[str, Any]:
    cloudpickle = _cloudpickle()
    kept: dict[str, Any] = {}
    skipped: list[str] = []
    for name, value in list(namespace.items()):
        if name in DRIVER_NAMES:
            continue
        try:
            _pickler(cloudpickle, _Discard(), namespace, {}).dump(value)
        except Exception as exc:  # noqa: BLE001 (whatever stops a value pickling is its reason to be skipped)
            skipped.append(f"{name}: {_why(exc)}")
            continue
        kept[name] = value
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ARCHIVE)
    fd = os.open(ARCHIVE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    # In the order `restore` needs them: the files (a `%pip install`'s site directory among
    # them), the state (the paths to put on sys.path), then the globals that may import them.
    with (
        os.fdopen(fd, "wb") as raw,
        tarfile.open(fileobj=raw, mode="w:", format=tarfile.PAX_FORMAT) as tar,
        tempfile.TemporaryFile() as pkl,
    ):
        _pickler(cloudpickle, pkl, namespace, kept).dump(kept)
        skipped.extend(_add_workspace(tar))
        shown = skipped[:MAX_SKIPPED]
        if len(skipped) > MAX_SKIPPED:
            shown.append(f"…: {len(skipped) - MAX_SKIPPED} more not listed")
        state = json.dumps(
            {"format": FORMAT, "globals": sorted(kept), "skipped": shown, "paths": extra_paths}
        ).encode()
        info = tarfile.TarInfo("state.json")
        info.size, info.mode = len(state), 0o600
        tar.addfile(info, io.BytesIO(state))
        info = tarfile.TarInfo("globals.pkl")
        info.size, info.mode = pkl.tell(), 0o600
        pkl.seek(0)
        tar.addfile(info, pkl)
    return {"globals": len(kept), "skipped": shown, "bytes": os.stat(ARCHIVE).st_size}


def _add_workspace(tar: tarfile.TarFile) -> list[str]:
    """Add the cwd's directories and regular files under `workspace/`; what was left out."""
    skipped: list[str] = []
    for rel, st in _walk("."):
        if rel in SERVERS:
            continue
        if stat.S_ISDIR(st.st_mode):
            info = tarfile.TarInfo(f"workspace/{rel}")
            info.type, info.mode = tarfile.DIRTYPE, stat.S_IMODE(st.st_mode)
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                skipped.append(f"{rel}: {_why(exc)}")
                continue
            with os.fdopen(fd, "rb") as fh:
                info = tarfile.TarInfo(f"workspace/{rel}")
                info.size, info.mode, info.mtime = os.fstat(fd).st_size, stat.S_IMODE(st.st_mode), st.st_mtime
                tar.addfile(info, fh)
        else:
            skipped.append(f"{rel}: not a regular file or directory (links and special files are not kept)")
    return skipped


def _walk(top: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under top (relative paths), parents before children, links not followed."""
    stack = [""]
    while stack:
        base = stack.pop()
        try:
            names = sorted(os.listdir(os.path.join(top, base) if base else top))
        except OSError:
            continue
        for name in names:
            rel = f"{base}/{name}" if base else name
            try:
                st = os.lstat(os.path.join(top, rel))
            except OSError:
                continue
            yield rel, st
            if stat.S_ISDIR(st.st_mode):
                stack.append(rel)


def restore(namespace_for: Callable[[dict[str, Any], list[str]], None]) -> dict[str, Any]:
    """Read ARCHIVE from the cwd (then unlink it): its files into the cwd, its globals handed
    to `namespace_for` as the interpreter's new namespace. The report: {"globals": n}."""
    fd = os.open(ARCHIVE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    os.unlink(ARCHIVE)  # its space is freed as it is closed, whatever happens
    state: dict[str, Any] | None = None
    loaded: dict[str, Any] | None = None
    paths: list[str] = []
    with os.fdopen(fd, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        for member in tar:
            if member.name == "state.json" and member.isfile() and member.size <= MAX_STATE_BYTES:
                state, paths = _state(_read(tar, member))
            elif member.name == "globals.pkl" and member.isfile() and state is not None:
                # Straight from the archive's file (the tar's own reader costs twice as long); the
                # tar finds its next member from its own offset.
                raw.seek(member.offset_data)
                value = pickle.load(raw)  # noqa: S301 (untrusted, and unpickled only here: in the jail)
                if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                    raise ValueError("globals.pkl does not hold a dict of names")
                loaded = value
            elif member.name.startswith("workspace/") and member.name[len("workspace/") :] not in SERVERS:
                _extract(tar, member, member.name[len("workspace/") :])
    if state is None or loaded is None:
        raise ValueError("the snapshot is incomplete (no state.json, then globals.pkl)")
    for name in DRIVER_NAMES:
        loaded.pop(name, None)
    namespace_for(loaded, paths)
    return {"globals": len(loaded)}


def _state(data: bytes) -> tuple[dict[str, Any], list[str]]:
    """state.json, checked, and its paths, put on sys.path: what the globals may import from."""
    state = json.loads(data)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"not a snapshot of format {FORMAT}")
    listed = state.get("paths")
    paths = [p for p in listed if isinstance(p, str)] if isinstance(listed, list) else []
    for path in reversed(paths):
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
    return state, paths


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    fh = tar.extractfile(member)
    return fh.read() if fh is not None else b""


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str) -> None:
    """One member into the cwd: a directory or a regular file, nothing else, each path part
    opened relative to its parent's descriptor without following links."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts) or rel.startswith("/"):
        raise ValueError(f"refused path in snapshot: {rel!r}")
    if not (member.isdir() or member.isfile()):
        raise ValueError(f"refused entry in snapshot (not a file or directory): {rel!r}")
    dir_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        last = parts if member.isdir() else parts[:-1]
        for part in last:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=dir_fd)
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = nxt
        mode = member.mode & 0o755 | 0o600
        if member.isdir():
            os.fchmod(dir_fd, mode | 0o100)
            return
        fd = os.open(
            parts[-1],
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode,
            dir_fd=dir_fd,
        )
        src = tar.extractfile(member)
        with os.fdopen(fd, "wb") as out:
            while src is not None and (chunk := src.read(1 << 20)):
                out.write(chunk)
    finally:
        os.close(dir_fd)
