"""What the notebook lines of appliance.inside.notebook call, inside the jail (standard library
only): shell commands and `pip install`.

Shell commands run in this jail (same uid, namespaces, limits, cwd) with `/bin/sh -c`; their
output is read from pipes and written to the cell's own sys.stdout/sys.stderr, so it arrives
in order with the cell's prints. A non-zero exit status is written to stderr and kept in
`_exit_code`, as IPython does; the cell goes on. An interrupt or timeout kills the command's
whole process group.

A `%pip` (or `!pip`) line that does not install what it names ends the cell with a PipError
naming the packages and why (not in the wheelhouse, an option refused, pip's own failure), so
the run ends `error` and the agent cannot mistake it for success; `_exit_code` is set first.
`pip list` lists what this interpreter can import (the run's own installs included) and what
the wheelhouse offers.

`pip install` works only with an operator's wheelhouse (APPLIANCE_WHEELHOUSE, mounted
read-only): names it lacks are refused with a list of what it has, before pip starts. A
request the server's wheel cache (APPLIANCE_WHEEL_CACHE: wheels it unpacked once, read-only
here) covers whole is satisfied by putting the cached directories on sys.path: no copy, no
pip. Anything else runs pip with `--no-index --find-links <wheelhouse> --target <site>`, the
run's own site directory under /workspace (a session keeps it; the run's disk and time limits
bound it). Both go on sys.path of this interpreter and on PYTHONPATH of its shell commands.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, NoReturn, TextIO

SITE_DIR = ".appliance/site-packages"  # under the cwd (/workspace): the run's own site directory
PIP_FLAGS = ("-q", "--quiet", "-U", "--upgrade", "--no-deps", "--force-reinstall", "--pre")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")
_WHEEL_SUFFIXES = (".whl", ".tar.gz", ".zip")
READ_CHUNK = 65536


class PipError(Exception):
    """A `%pip` line that failed: the cell ends here, with this as its error."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheelhouse_contents(wheelhouse: str) -> dict[str, list[str]]:
    """Normalized distribution name -> versions, from the file names of a wheelhouse."""
    found: dict[str, list[str]] = {}
    with contextlib.suppress(OSError):
        for entry in sorted(os.listdir(wheelhouse)):
            suffix = next((s for s in _WHEEL_SUFFIXES if entry.endswith(s)), None)
            if suffix is None:
                continue
            stem = entry[: -len(suffix)]
            if suffix == ".whl":
                parts = stem.split("-")
                if len(parts) < 5:
                    continue
                name, version = parts[0], parts[1]
            else:
                name, _, version = stem.rpartition("-")
                if not name:
                    continue
            found.setdefault(normalize(name), []).append(version)
    return found


def is_wheelhouse_requirement(req: str) -> bool:
    """Whether req names a package by name (extras, version specifiers, markers) rather than
    by a direct reference (`name @ url`), a URL or a path, which pip would take from there
    instead of from the wheelhouse (--no-index stops only the index)."""
    name, rest = split_requirement(req)
    if not name or "@" in rest or "://" in req or "/" in req or "\\" in req or req.endswith(_WHEEL_SUFFIXES):
        return False
    return not rest or rest[0] in "[=<>!~;,"


def split_requirement(req: str) -> tuple[str, str]:
    """(normalized name, the rest: extras, specifiers, markers) of a requirement string."""
    match = _NAME.match(req)
    if match is None:
        return "", req
    return normalize(match.group(0)), req[match.end() :].strip()


class Magics:
    """The HOOK object of appliance.inside.notebook, one per driver (a session keeps it)."""

    def __init__(self, namespace: dict[str, Any], env: Mapping[str, str]) -> None:
        self.namespace = namespace
        self.wheelhouse = env.get("APPLIANCE_WHEELHOUSE") or None
        self.cache = env.get("APPLIANCE_WHEEL_CACHE") or None
        self.site = os.path.join(os.getcwd(), SITE_DIR)
        self.paths: list[str] = []  # what installs added to sys.path, newest first

    # -- shell ---------------------------------------------------------------------------
    def shell(self, command: str) -> None:
        """Run `command` with /bin/sh in this jail, its output in order with the cell's."""
        self._set_status(self._run(["/bin/sh", "-c", command]), "command")

    def _run(self, argv: list[str]) -> int:
        env = dict(os.environ)
        if self.paths:
            env["PYTHONPATH"] = os.pathsep.join(self.paths)
        out, err = sys.stdout, sys.stderr
        for stream in (out, err):
            with contextlib.suppress(Exception):
                stream.flush()
        # S603: the cell's own `!` command, run inside the jail: the jail is the boundary
        proc = subprocess.Popen(  # noqa: S603
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        try:
            self._pump(proc, out, err)
            return proc.wait()
        except BaseException:  # an interrupt or the run's timeout: the command ends with the cell
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()

    @staticmethod
    def _pump(proc: subprocess.Popen[bytes], out: TextIO, err: TextIO) -> None:
        if proc.stdout is None or proc.stderr is None:
            raise RuntimeError("_pump needs the command's stdout and stderr pipes")
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                for key, _ in sel.select():
                    chunk = os.read(key.fd, READ_CHUNK)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    target: TextIO = key.data
                    target.write(chunk.decode("utf-8", "replace"))
                    target.flush()

    def _set_status(self, code: int, what: str) -> None:
        self.namespace["_exit_code"] = code
        if code < 0:
            sys.stderr.write(f"[{what} killed by signal {-code}]\n")
        elif code:
            sys.stderr.write(f"[{what} exited with status {code}]\n")

    # -- pip -----------------------------------------------------------------------------
    def pip(self, args: str) -> None:
        """`pip install ...` from the operator's wheelhouse only, or `pip list`; a failure
        raises PipError, ending the cell."""
        try:
            words = shlex.split(args)
        except ValueError as exc:
            self._fail(2, f"pip {args}: {exc}")
        if words[:1] == ["list"]:
            self._list(words[1:])
            return
        if words[:1] != ["install"]:
            self._fail(
                2,
                f"pip: only `pip install <package> ...` and `pip list` are supported here (got `pip {args}`)",
            )
        self._install(words[1:])

    def _fail(self, code: int, message: str) -> NoReturn:
        self.namespace["_exit_code"] = code
        raise PipError(message)

    def _list(self, words: list[str]) -> None:
        if words:
            self._fail(2, f"pip list: no options are supported here (got {' '.join(words)})")
        argv = [sys.executable, "-m", "pip", "list", "--disable-pip-version-check", "--no-index"]
        code = self._run(argv)  # this interpreter's sys.path, with the run's installs (PYTHONPATH)
        self._set_status(code, "pip")
        if code:
            self._fail(code, f"pip list failed (exit status {code}): see stderr")
        if self.wheelhouse is not None:
            offered = wheelhouse_contents(self.wheelhouse)
            listing = ", ".join(f"{name} {' '.join(versions)}" for name, versions in sorted(offered.items()))
            sys.stdout.write(
                f"\n%pip install can add, from the appliance's wheelhouse: {listing or 'nothing'}\n"
            )
        else:
            sys.stdout.write("\n%pip install is off on this appliance (no wheelhouse)\n")

    def _install(self, words: list[str]) -> None:
        flags = [w for w in words if w.startswith("-")]
        reqs = [w for w in words if not w.startswith("-")]
        bad = [f for f in flags if f not in PIP_FLAGS]
        if bad:
            self._fail(2, f"pip: unsupported option(s) {' '.join(bad)}; allowed: {' '.join(PIP_FLAGS)}")
        if not reqs:
            self._fail(2, "pip: name the package(s) to install, e.g. `%pip install requests`")
        direct = [r for r in reqs if not is_wheelhouse_requirement(r)]
        if direct:
            self._fail(
                2,
                f"pip: {' '.join(direct)}: direct references, URLs and paths are refused; name "
                "packages of the appliance's wheelhouse, e.g. `%pip install requests==2.32.3`",
            )
        if not flags and all(_satisfied(r) for r in reqs):
            # As pip answers, with or without a wheelhouse: agent frameworks ask for what they
            # import (smolagents' E2B executor, `!pip install pillow numpy`) before each run.
            for req in reqs:
                sys.stdout.write(f"Requirement already satisfied: {req}\n")
            self._set_status(0, "pip")
            return
        if self.wheelhouse is None:
            self._fail(
                1,
                f"pip install {' '.join(reqs)}: pip install is off on this appliance: runs have no "
                "network, and no wheelhouse is configured (the operator sets SANDBOX_WHEELHOUSE "
                "to a directory of wheels)",
            )
        available = wheelhouse_contents(self.wheelhouse)
        names = [split_requirement(r)[0] for r in reqs]
        missing = [r for r, name in zip(reqs, names, strict=True) if not name or name not in available]
        if missing:
            listing = ", ".join(
                f"{name} {' '.join(versions)}" for name, versions in sorted(available.items())
            )
            self._fail(
                1,
                f"not in the appliance's wheelhouse: {', '.join(missing)}; nothing was installed. "
                f"The wheelhouse has: {listing or 'nothing'}",
            )
        if not flags and self._from_cache(reqs):
            self._set_status(0, "pip")
            return
        argv = [
            sys.executable,
            "-I",
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            self.wheelhouse,
            "--target",
            self.site,
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--no-input",
            "--progress-bar",
            "off",
            *flags,
            *reqs,
        ]
        code = self._run(argv)
        self._set_status(code, "pip")
        if code:
            self._fail(
                code, f"pip install {' '.join(reqs)} failed (exit status {code}): pip's reasons are on stderr"
            )
        self._add_path(self.site)

    def _from_cache(self, reqs: list[str]) -> bool:
        """Satisfy reqs from the server's unpacked-wheel cache when it covers them and all
        they need; False (and nothing changed) when it does not."""
        manifest = self._manifest()
        if not manifest:
            return False
        chosen: dict[str, dict[str, Any]] = {}
        todo: list[Any] = list(reqs)
        while todo:
            item = todo.pop()
            if isinstance(item, dict):  # a cached wheel's own requirement, judged by the server
                if item.get("specifier") and not item.get("cached"):
                    return False  # a version range the cache cannot meet: pip decides
                item = str(item.get("name", ""))
            name, rest = split_requirement(str(item))
            if name in chosen:
                continue
            entry = manifest.get(name)
            if entry is None or not entry.get("cacheable"):
                if name not in [split_requirement(r)[0] for r in reqs] and _installed(name):
                    continue  # a dependency the environment already has
                return False
            if rest and rest != f"=={entry['version']}":
                return False  # a version range: pip decides
            chosen[name] = entry
            todo += list(entry.get("requires", []))
        for entry in chosen.values():
            self._add_path(os.path.join(str(self.cache), str(entry["path"])))
        done = ", ".join(f"{e['name']}-{e['version']}" for e in chosen.values())
        sys.stdout.write(f"Installed {done} (from the appliance's wheel cache)\n")
        return True

    def _manifest(self) -> dict[str, Any]:
        if self.cache is None:
            return {}
        try:
            with open(os.path.join(self.cache, "manifest.json")) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return {}
        packages = data.get("packages") if isinstance(data, dict) else None
        return packages if isinstance(packages, dict) else {}

    def _add_path(self, path: str) -> None:
        if path not in sys.path:
            sys.path.insert(0, path)
        if path not in self.paths:
            self.paths.insert(0, path)
        importlib.invalidate_caches()


def _satisfied(req: str) -> bool:
    """Whether an installed distribution meets req as named: a bare name, or `name==version`
    of the installed version (anything else, pip decides)."""
    name, rest = split_requirement(req)
    if not name or (rest and not rest.startswith("==")):
        return False
    import importlib.metadata  # as in _installed

    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return not rest or rest[2:].strip() == version


def _installed(name: str) -> bool:
    # Imported here, by `%pip` alone: importlib.metadata brings some 40 modules (zipfile, and
    # with it bz2 and lzma and their libraries) into every jail's driver, which made the
    # mappings the disk check reads as each cell ends a fifth longer.
    import importlib.metadata

    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
