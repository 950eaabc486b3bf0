"""The operator's wheelhouse (SANDBOX_WHEELHOUSE) and the shared wheel cache the server makes
from it, so that `%pip install x` in a jail (appliance.inside.magics) need not install again.

Layout, under SANDBOX_TMP_ROOT:
    appliance/wheels-<hash>/         0755 root, read-only in jails; <hash> of the wheelhouse listing
        manifest.json                name -> {name, version, path, requires, cacheable}
        <name>-<version>/            a pure wheel (py3-none-any), unpacked: importable from sys.path

`requires` lists a cached wheel's unconditional requirements as {name, specifier, cached}:
`cached` is true when the cache holds that name at a version its specifier allows (judged
here with packaging's SpecifierSet, since the jail's side has only the standard library). A
requirement with a version range the cache cannot satisfy sends the install to pip, which
then decides from the wheelhouse.

Only pure wheels are unpacked: an unpacked pure wheel is exactly what pip would install
(modules, data, .dist-info), while platform wheels and sdists need pip's judgement; those, and
names with several versions or with requirements that carry environment markers, are marked
not cacheable and go through pip in the jail (still only from the wheelhouse). The cache is
written by the server (root) once per wheelhouse content and never by a jail: it is mounted
read-only and owned by root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from appliance.core.errors import StartupError
from appliance.sandbox.workdir import reusable, staged

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_UNPACKED_BYTES = 512 * 1024 * 1024  # per wheel: a zip bomb in the wheelhouse stays a pip matter
MANIFEST_FORMAT = 2  # part of the cache's name: a cache of an older layout is never reused


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def check_wheelhouse(path: Path) -> None:
    """StartupError unless `path` is a directory of files the server can list."""
    if not path.is_dir():
        raise StartupError(f"SANDBOX_WHEELHOUSE: {path} is not a directory")
    try:
        os.listdir(path)
    except OSError as exc:
        raise StartupError(f"SANDBOX_WHEELHOUSE: cannot list {path}: {exc}") from exc


def stage_wheel_cache(wheelhouse: Path, tmp_root: Path) -> Path:
    """Unpack the wheelhouse's pure wheels once per wheelhouse content; returns the cache."""
    check_wheelhouse(wheelhouse)
    wheels = sorted(p for p in wheelhouse.iterdir() if p.name.endswith(".whl") and p.is_file())
    digest = hashlib.sha256(f"manifest {MANIFEST_FORMAT}\n".encode())
    for wheel in wheels:
        info = wheel.stat()
        digest.update(f"{wheel.name}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    name = f"wheels-{digest.hexdigest()[:16]}"
    target = tmp_root / "appliance" / name
    if reusable(tmp_root, name, "manifest.json"):  # only a cache wholly the server's own
        return target
    with staged(target, ".wheels-") as staging:
        manifest = _unpack_all(wheels, staging)
        (staging / "manifest.json").write_text(json.dumps({"packages": manifest}, indent=1, sort_keys=True))
    return target


def _unpack_all(wheels: list[Path], staging: Path) -> dict[str, dict[str, object]]:
    manifest: dict[str, dict[str, object]] = {}
    versions: dict[str, set[str]] = {}
    for wheel in wheels:
        parts = wheel.name[:-4].split("-")
        if len(parts) < 5 or not _NAME.match(parts[0]):
            continue
        name, version = normalize(parts[0]), parts[1]
        versions.setdefault(name, set()).add(version)
        pure = parts[-2] == "none" and parts[-1] == "any" and parts[-3].startswith("py3")
        entry: dict[str, object] = {
            "name": parts[0],
            "version": version,
            "path": None,
            "requires": [],
            "cacheable": False,
        }
        if pure:
            folder = f"{name}-{version}"
            requires = _unpack(wheel, staging / folder)
            if requires is not None:
                entry.update(path=folder, requires=requires, cacheable=True)
        manifest[name] = entry
    for name, seen in versions.items():
        if len(seen) > 1:  # which one a request means is pip's decision
            manifest[name]["cacheable"] = False
    for entry in manifest.values():
        listed = entry["requires"]
        for req in listed if isinstance(listed, list) else ():  # always a list: made above
            req["cached"] = satisfied_by(manifest.get(str(req["name"])), str(req["specifier"]))
    return manifest


def satisfied_by(entry: dict[str, object] | None, specifier: str) -> bool:
    """Whether a cached manifest entry's version is one `specifier` allows (pure).

    Pre-releases count only where the specifier names one, as pip's default; a version
    packaging cannot read is never taken as allowed."""
    if entry is None or not entry.get("cacheable"):
        return False
    try:
        return SpecifierSet(specifier).contains(Version(str(entry["version"])))
    except InvalidVersion:
        return False


def _unpack(wheel: Path, dest: Path) -> list[dict[str, object]] | None:  # noqa: C901 (one wheel's checks in order; each branch refuses an unsafe member or requirement)
    """Unpack one wheel safely; its unconditional requirements ({name, specifier}), or None
    when it cannot be cached (a bad archive, an unsafe member, a marker only pip can judge, a
    requirement packaging cannot read, or one asking for a dependency's extras)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = archive.infolist()
            if sum(m.file_size for m in members) > MAX_UNPACKED_BYTES:
                return None
            for member in members:
                path = Path(member.filename)
                if path.is_absolute() or ".." in path.parts or stat.S_ISLNK(member.external_attr >> 16):
                    shutil.rmtree(dest, ignore_errors=True)
                    return None
            metadata = next(
                (
                    m
                    for m in members
                    if m.filename.endswith(".dist-info/METADATA") and m.filename.count("/") == 1
                ),
                None,
            )
            if metadata is None:
                return None
            headers = HeaderParser().parsestr(archive.read(metadata).decode("utf-8", "replace"))
            requires: list[dict[str, object]] = []
            for line in headers.get_all("Requires-Dist") or []:
                try:
                    req = Requirement(str(line))
                except InvalidRequirement:
                    return None
                if req.marker is not None:
                    if "extra" in str(req.marker):
                        continue  # an optional extra: not needed by a plain install
                    return None
                if req.extras or req.url:
                    return None  # a dependency's extras or a direct URL: pip's judgement
                requires.append({"name": normalize(req.name), "specifier": str(req.specifier)})
            dest.mkdir(parents=True)
            archive.extractall(dest)
            return requires
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError):
        shutil.rmtree(dest, ignore_errors=True)
        return None
