"""Per-run directories and the shared read-only runtime, under SANDBOX_TMP_ROOT.

Layout:
    <tmp_root>/appliance/                  0755 root
        runtime-<hash>/                    0755, read-only in jails: driver, mpl backend, font cache
        srv-<pid ns>-<pid>-<start>/        0711, one per server process (appliance.jail.instance)
            <run id>/                      0700 uid:gid, mounted as /workspace
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from appliance import fstree
from appliance.errors import StartupError
from appliance.jail import instance as server_instance

log = logging.getLogger("appliance.workdir")

RUNTIME_FILES = ("driver.py", "appliance_mpl.py")
SOURCE_DIR = Path(__file__).resolve().parent
# The driver's half of the server-driver channel, staged as `appliance.jail.channel`, and
# its notebook-line helpers (appliance.jail.notebook, appliance.jail.magics).
JAIL_MODULES = tuple(SOURCE_DIR / name for name in ("channel.py", "notebook.py", "magics.py"))
# appliance/tools/ is staged as the package `appliance.tools` (runtime/appliance/tools/), so
# jailed code can import it; nothing else of the server side goes into the runtime.
TOOLS_DIR = SOURCE_DIR.parent / "tools"


class RunDirs:
    """Creates, measures and removes run directories for one server process."""

    def __init__(self, tmp_root: Path, uid: int, gid: int) -> None:
        self.base = tmp_root / "appliance"
        self.instance = self.base / server_instance.name()
        self.uid = uid
        self.gid = gid
        self.accounts: tuple[Path, Path] | None = None  # (passwd, group) for jails; see prepare()

    def prepare(self) -> list[Path]:
        """Create this server's directory; remove those of servers that are gone. Returns them."""
        try:
            self.base.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(self.base, 0o755)
            self.instance.mkdir(mode=0o711, exist_ok=True)
            os.chmod(self.instance, 0o711)
            self.accounts = self.stage_accounts()
        except OSError as exc:
            raise StartupError(f"SANDBOX_TMP_ROOT: cannot create {self.instance}: {exc}") from exc
        return self.purge_stale()

    def stage_accounts(self) -> tuple[Path, Path]:
        """A passwd and a group file naming only root and the sandbox user, for the jail's
        /etc (the host's list its accounts). Written atomically; shared by servers alike."""
        try:
            user = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            user = "sandbox"
        try:
            group = grp.getgrgid(self.gid).gr_name
        except KeyError:
            group = user
        target = self.base / f"accounts-{self.uid}-{self.gid}"
        target.mkdir(mode=0o755, exist_ok=True)
        files = {
            "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"{user}:x:{self.uid}:{self.gid}::/workspace:/usr/sbin/nologin\n",
            "group": f"root:x:0:\n{group}:x:{self.gid}:\n",
        }
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=target)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.rename(tmp, target / name)
        return target / "passwd", target / "group"

    def purge_stale(self) -> list[Path]:
        """Kill the jails of servers that are gone and remove their directories (a live server's,
        and those of servers in other PID namespaces, are left alone: `appliance.jail.instance`).

        Never fails the start on what such a run left (any depth, any content): what cannot
        be removed is logged and left for the next start."""
        removed: list[Path] = []
        try:
            entries = sorted(self.base.iterdir())
        except OSError as exc:
            log.error("cannot list the temp root", extra={"path": str(self.base), "error": str(exc)})
            return removed
        for entry in entries:
            owner = server_instance.parse(entry.name)
            if owner is None or entry == self.instance:
                continue
            if server_instance.gone(owner):  # never one of another PID namespace's
                # Jails of a server that died (kill -9) outlive it: firejail is setuid, so no
                # parent-death signal reaches it. Kill them before their directories go.
                kill_jails_under(entry)
                if fstree.remove_tree(entry):
                    removed.append(entry)
        return removed

    def path(self, run_id: str) -> Path:
        """Where run run_id's directory is (made by `create`)."""
        return self.instance / run_id

    def create(self, run_id: str) -> Path:
        path = self.path(run_id)
        try:
            path.mkdir(mode=0o700)
        except FileNotFoundError:
            # Our directory was removed from under us (an operator clearing the temp
            # root): make it again, as prepare() did, rather than fail every run.
            self.instance.mkdir(mode=0o711, parents=True, exist_ok=True)
            os.chmod(self.instance, 0o711)
            path.mkdir(mode=0o700)
        (path / "outputs").mkdir(mode=0o755)
        for p in (path / "outputs", path):
            os.chown(p, self.uid, self.gid)
        return path

    def remove(self, path: Path) -> None:
        """Remove a run directory, whatever the code made of it (links are never followed,
        depth costs no recursion)."""
        fstree.remove_tree(path)

    def remove_instance(self) -> None:
        fstree.remove_tree(self.instance)


def stage_runtime(tmp_root: Path, python: Path) -> Path:
    """Install the in-jail runtime once per content hash; build matplotlib's font cache there."""
    digest = hashlib.sha256()
    for name in RUNTIME_FILES:
        digest.update((SOURCE_DIR / name).read_bytes())
    for tool in _tool_files():
        digest.update(tool.name.encode() + tool.read_bytes())
    for module in JAIL_MODULES:
        digest.update(module.name.encode() + module.read_bytes())
    digest.update(str(python).encode())
    target = tmp_root / "appliance" / f"runtime-{digest.hexdigest()[:16]}"
    if (target / "ready").exists():
        return target
    with staged(target, ".runtime-") as staging:
        for name in RUNTIME_FILES:
            shutil.copyfile(SOURCE_DIR / name, staging / name)
        (staging / "appliance" / "tools").mkdir(parents=True)
        (staging / "appliance" / "jail").mkdir()
        (staging / "appliance" / "__init__.py").write_text(
            '"""In-jail half only: the tools and the driver channel."""\n'
        )
        (staging / "appliance" / "jail" / "__init__.py").write_text(
            '"""The driver channel and notebook lines only."""\n'
        )
        for module in JAIL_MODULES:
            shutil.copyfile(module, staging / "appliance" / "jail" / module.name)
        for tool in _tool_files():
            shutil.copyfile(tool, staging / "appliance" / "tools" / tool.name)
        mpl = staging / "matplotlib"
        mpl.mkdir()
        env = {"MPLCONFIGDIR": str(mpl), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"}
        # Builds fontlist-*.json once; missing matplotlib is fine (no cache needed then).
        subprocess.run(  # noqa: S603 (the jails' python, a fixed import)
            [str(python), "-I", "-c", "import matplotlib.font_manager"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )
        (staging / "ready").write_text("ok\n")
    return target


@contextlib.contextmanager
def staged(target: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory beside target to build a read-only tree in; when the block ends
    normally the tree is published as target, and the staging directory never stays."""
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield staging
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, target: Path) -> None:
    """Make a staged tree readable by everyone and writable by none but root (directories
    0755, files 0644), then rename it into place; if another server published the same
    content first, keep theirs and drop ours."""
    for root, _dirs, files in os.walk(staging):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    try:
        os.rename(staging, target)
    except OSError:  # another server staged the same content first
        shutil.rmtree(staging, ignore_errors=True)


def _tool_files() -> list[Path]:
    return sorted(TOOLS_DIR.glob("*.py"))


def kill_jails_under(instance: Path) -> list[int]:
    """SIGKILL every firejail whose --private run directory lies under instance; returns their pids.

    Killing the firejail processes ends each jail's PID namespace, and with it every process
    the code started there.
    """
    prefix = f"--private={instance}/".encode()
    killed: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            continue
        if any(arg.startswith(prefix) for arg in args):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                continue
    return killed
