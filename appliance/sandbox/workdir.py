"""Per-run directories and the shared read-only runtime, under SANDBOX_TMP_ROOT.

Layout:
    <tmp_root>/appliance/                  0755 the server's uid (root)
        runtime-<hash>/                    0755, read-only in jails: driver, mpl backend, font cache
        accounts-<uid>-<gid>/              0755, the jails' passwd and group, one per jail uid
        uids/                              0700, a lock file per uid of SANDBOX_UID_RANGE (`uids`)
        srv-<pid ns>-<pid>-<start>/        0711, one per server process (appliance.sandbox.instance)
            etc/                           0755, the jails' /etc where the server is root (`etcdir`)
            <run id>/                      0700 uid:gid, mounted as /workspace; a tmpfs
                                           of its own where the server is root (`runfs`)

Nothing here is used or reused before `appliance.sandbox.trust` has checked it by descriptor:
the root's chain from `/`, then each directory the server makes or finds. A staged tree
that is not wholly the server's own is removed and staged again.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import logging
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from appliance.core.errors import StartupError
from appliance.sandbox import etcdir, fstree, runfs, signals, trust
from appliance.sandbox import instance as server_instance
from appliance.sandbox.spec import ETC_FILES

log = logging.getLogger("appliance.workdir")

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# What a jail's runtime holds, the one declaration of it: the folder `appliance/inside/` whole
# (every .py file under it) and `appliance/tools/__init__.py`, the tools' public face that jailed
# code imports. Nothing else of the server side goes into the runtime.
INSIDE_DIR = PACKAGE_DIR / "inside"
TOOLS_FACE = PACKAGE_DIR / "tools" / "__init__.py"
DRIVER = Path("appliance") / "inside" / "driver.py"  # relative to the runtime
DRIVER_BYTECODE = DRIVER.with_suffix(".pyc")  # the driver compiled, beside it (`stage_runtime`)
# How a runtime is staged (part of its name): a runtime staged another way is not reused.
STAGING = b"bytecode, driver.pyc"
BINDS_SUFFIX = ".binds"  # a run directory's bind table, beside it (`RunDirs.create`)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def runtime_sources() -> list[tuple[Path, Path]]:
    """Each staged file: (its source, its path relative to the runtime), in a fixed order."""
    files = [
        (f, Path("appliance") / "inside" / f.relative_to(INSIDE_DIR))
        for f in sorted(INSIDE_DIR.rglob("*.py"))
    ]
    return [*files, (TOOLS_FACE, Path("appliance") / "tools" / "__init__.py")]


class RunDirs:
    """Creates, measures and removes run directories for one server process."""

    def __init__(self, tmp_root: Path, uid: int, gid: int, sizes: runfs.Sizes | None = None) -> None:
        self.root = tmp_root
        self.base = tmp_root / "appliance"
        self.instance = self.base / server_instance.name()
        self.uid = uid
        self.gid = gid
        self.server_uid = os.geteuid()
        # Each run directory a tmpfs of these sizes (`runfs`), or a plain directory (None: a
        # server that is not root cannot mount; the disk quota is then the server's check only).
        self.sizes = sizes
        self.accounts: tuple[Path, Path] | None = None  # (passwd, group) for jails; see prepare()
        self.etc: Path | None = None  # the jails' prepared /etc (`etcdir`); see prepare()
        self._etc_files: tuple[str, ...] = ()
        self._etc_lock = threading.Lock()
        self._staged: dict[tuple[int, int], tuple[Path, Path]] = {}  # accounts_for's, by (uid, gid)

    def prepare(self, etc_files: tuple[str, ...] | None = ETC_FILES) -> list[Path]:
        """Create this server's directory (`prepare_own`); remove those of servers that are
        gone. Returns them."""
        self.prepare_own(etc_files)
        return self.purge_stale()

    def prepare_own(self, etc_files: tuple[str, ...] | None = ETC_FILES) -> None:
        """Create this server's directory and stage the jails' accounts; a root server also
        prepares the jails' /etc there from the host's `etc_files` (`etcdir`; None: jails copy
        their own with firejail's --private-etc). StartupError when the root or anything in it
        is not the server's own (`trust`)."""
        try:
            with self._instance() as inst, open_base(self.root, self.server_uid) as base_fd:
                self.accounts = self.stage_accounts(base_fd, self.uid, self.gid)
                if etc_files is not None and self.server_uid == 0 and self.etc is None:
                    self.etc = etcdir.prepare(inst, self.instance, etc_files)
                    self._etc_files = etc_files
        except OSError as exc:
            raise StartupError(f"SANDBOX_TMP_ROOT: cannot create {self.instance}: {exc}") from exc

    def _etc_present(self, inst: int) -> None:
        """The prepared /etc, prepared again where an operator cleared the temp root since (as
        the instance directory is made again): a jail started without it would not start."""
        if self.etc is None:
            return
        with self._etc_lock:
            try:
                os.stat(etcdir.NAME, dir_fd=inst, follow_symlinks=False)
            except FileNotFoundError:
                etcdir.prepare(inst, self.instance, self._etc_files)

    @contextlib.contextmanager
    def _instance(self) -> Iterator[int]:
        """This server's checked instance directory, made if absent (again, if an operator
        cleared the temp root), the whole chain checked anew each time."""
        with open_base(self.root, self.server_uid) as base_fd:
            fd = trust.ensure_dir(base_fd, self.base, self.instance.name, 0o711, self.server_uid)
        with trust.held(fd):
            yield fd

    def accounts_for(self, uid: int, gid: int) -> tuple[Path, Path]:
        """The passwd and group files of a jail that runs as uid:gid (`stage_accounts`), staged
        on first use by this server. Blocking I/O: call it in a thread. StartupError (a
        JailFailure to the caller) when the tree is not the server's own."""
        if (uid, gid) == (self.uid, self.gid) and self.accounts is not None:
            return self.accounts
        found = self._staged.get((uid, gid))
        if found is None:
            with open_base(self.root, self.server_uid) as base_fd:
                found = self._staged[uid, gid] = self.stage_accounts(base_fd, uid, gid)
        return found

    def stage_accounts(self, base_fd: int, uid: int, gid: int) -> tuple[Path, Path]:
        """A passwd and a group file naming only root and the sandbox user as uid:gid, for
        the jail's /etc (the host's list its accounts). Written atomically, by descriptor;
        shared by servers alike. A uid of SANDBOX_UID_RANGE has no host account: it is named
        `sandbox`, as the jailed code knows its user."""
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = "sandbox"
        try:
            group = grp.getgrgid(gid).gr_name
        except KeyError:
            group = user
        name = f"accounts-{uid}-{gid}"
        files = {
            "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"{user}:x:{uid}:{gid}::/workspace:/usr/sbin/nologin\n",
            "group": f"root:x:0:\n{group}:x:{gid}:\n",
        }
        with trust.held(trust.ensure_dir(base_fd, self.base, name, 0o755, self.server_uid)) as dir_fd:
            for file, text in files.items():
                if _holds(dir_fd, file, text.encode(), self.server_uid):
                    # Left in place: a launching jail binds this file, and a bind onto a file
                    # replaced meanwhile fails (firejail mounts over it: ENOENT).
                    continue
                tmp = f".{file}-{secrets.token_hex(8)}"
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=dir_fd,
                )
                with os.fdopen(fd, "w") as fh:
                    os.fchmod(fd, 0o644)
                    fh.write(text)
                os.rename(tmp, file, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return self.base / name / "passwd", self.base / name / "group"

    def purge_stale(self) -> list[Path]:
        """Kill the jails of servers that are gone and remove their directories (a live server's,
        and those of servers in other PID namespaces, are left alone: `appliance.sandbox.instance`).

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
                # parent-death signal reaches it. Kill them before their directories go, and
                # detach their run directories' tmpfs (a removal stops at a mount point).
                kill_jails_under(entry)
                runfs.unmount_under(entry)
                if fstree.remove_tree(entry):
                    removed.append(entry)
        return removed

    def path(self, run_id: str) -> Path:
        """Where run run_id's directory is (made by `create`)."""
        return self.instance / run_id

    def create(
        self, run_id: str, uid: int | None = None, gid: int | None = None, binds: str | None = None
    ) -> Path:
        """Make run run_id's directory (and its outputs/), owned by the jail's uid:gid (default:
        the shared sandbox uid's); owner and
        mode are set on the descriptors made here, never through a path. Where run directories
        are sized (`sizes`), the directory is a tmpfs of its own, mounted through the
        instance's descriptor before anything is made in it (fail closed: no mount, no run).
        `binds`, the jail's bind table (`firejail.bind_table`), is written beside it
        (`binds_path`), root's alone, for the launcher's mount(8)."""
        uid = self.uid if uid is None else uid
        gid = self.gid if gid is None else gid
        with self._instance() as inst:
            self._etc_present(inst)
            os.mkdir(run_id, 0o700, dir_fd=inst)
            try:
                if binds is not None:
                    fd = os.open(run_id + BINDS_SUFFIX, _NEW_FILE, 0o600, dir_fd=inst)
                    with os.fdopen(fd, "w") as fh:
                        fh.write(binds)
                if self.sizes is not None:
                    runfs.mount_run(Path(f"/proc/self/fd/{inst}/{run_id}"), self.sizes, uid, gid)
                fd = os.open(run_id, fstree.DIR_FLAGS, dir_fd=inst)
                try:
                    os.mkdir("outputs", 0o755, dir_fd=fd)
                    out = os.open("outputs", fstree.DIR_FLAGS, dir_fd=fd)
                    try:
                        os.fchown(out, uid, gid)
                    finally:
                        os.close(out)
                    os.fchown(fd, uid, gid)
                finally:
                    os.close(fd)
            except BaseException:
                self.remove(self.path(run_id))
                raise
        return self.path(run_id)

    def binds_path(self, run_id: str) -> Path:
        """Where run run_id's bind table is (`create`): beside its directory, where only root
        writes."""
        return self.instance / (run_id + BINDS_SUFFIX)

    def remove(self, path: Path) -> None:
        """Remove a run directory, whatever the code made of it (links are never followed,
        depth costs no recursion), and its bind table; its tmpfs is detached first, which frees
        its pages once the jail's last process is gone, without walking what it holds."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path.with_name(path.name + BINDS_SUFFIX))
        if self.sizes is not None:
            try:
                runfs.unmount(path)
            except OSError as exc:  # left mounted: the removal below stops at it and says so
                log.error("cannot unmount a run directory", extra={"path": str(path), "error": str(exc)})
        fstree.remove_tree(path)

    def remove_instance(self) -> None:
        runfs.unmount_under(self.instance)
        fstree.remove_tree(self.instance)


@contextlib.contextmanager
def open_base(tmp_root: Path, server_uid: int) -> Iterator[int]:
    """`<tmp_root>/appliance`, made if absent, with the root's whole chain checked (`trust`)."""
    with trust.held(trust.open_root(tmp_root, server_uid)) as root_fd:
        fd = trust.ensure_dir(root_fd, tmp_root, "appliance", 0o755, server_uid)
    with trust.held(fd):
        yield fd


def reusable(tmp_root: Path, name: str, marker: str) -> bool:
    """Whether `<tmp_root>/appliance/<name>` is a finished staged tree (holding `marker`) that is
    wholly the server's own. One that is not (a link, another owner, anything writable by
    others) is removed, to be staged again."""
    server_uid = os.geteuid()
    base = tmp_root / "appliance"
    with open_base(tmp_root, server_uid) as base_fd:
        try:
            fd = os.open(name, fstree.DIR_FLAGS, dir_fd=base_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            problem: str | None = f"cannot be opened as a directory ({exc.strerror})"
        else:
            with trust.held(fd):
                problem = trust.policy(os.fstat(fd), server_uid, ancestor=False) or trust.tree_problem(
                    fd, server_uid
                )
                if problem is None:
                    try:
                        st = os.stat(marker, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        return False  # being staged (or left half-made): staged anew beside it
                    if stat.S_ISREG(st.st_mode):
                        return True
                    problem = f"{marker} is not a regular file"
    log.warning(
        "removing a staged tree that is not the server's own",
        extra={"path": str(base / name), "problem": problem},
    )
    if not fstree.remove_tree(base / name):
        raise trust.refusal(base / name, f"is not the server's own ({problem}) and could not be removed")
    return False


def runtime_name(python: Path) -> str:
    """The runtime's directory name: a hash of what is staged in it (and for which python)."""
    digest = hashlib.sha256()
    for source, rel in runtime_sources():
        digest.update(str(rel).encode() + b"\0" + source.read_bytes())
    digest.update(str(python).encode())
    digest.update(STAGING)
    return f"runtime-{digest.hexdigest()[:16]}"


def stage_runtime(tmp_root: Path, python: Path) -> Path:
    """Install the in-jail runtime once per content hash; build matplotlib's font cache there.
    A runtime found there is reused only when it is wholly the server's own (`reusable`)."""
    name = runtime_name(python)
    target = tmp_root / "appliance" / name
    if reusable(tmp_root, name, "ready"):
        return target
    with staged(target, ".runtime-") as staging:
        (staging / "appliance").mkdir()
        (staging / "appliance" / "__init__.py").write_text(
            '"""In-jail half only: appliance/inside and the tools."""\n'
        )
        for source, rel in runtime_sources():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / rel)
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
        # Its bytecode, compiled once here by the jails' python: a jail cannot write it (the
        # runtime is read-only there), so each would compile the modules it imports at start.
        # The driver runs as a script, which Python compiles at every start: it is compiled
        # beside it too, naming the path it is published at (its frames are known by it).
        compile_driver = "import py_compile, sys; py_compile.compile(*sys.argv[1:], doraise=True)"
        for argv in (
            ["-m", "compileall", "-q", str(staging / "appliance")],
            [
                "-c",
                compile_driver,
                str(staging / DRIVER),
                str(staging / DRIVER_BYTECODE),
                str(target / DRIVER),
            ],
        ):
            subprocess.run(  # noqa: S603 (the jails' python, the stdlib's compilers)
                [str(python), "-I", *argv],
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
    normally the tree is published as target, and the staging directory never stays. The
    caller has checked target's parent (`open_base`)."""
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


def _holds(dir_fd: int, name: str, data: bytes, owner: int) -> bool:
    """Whether `name` in dir_fd is already a regular file of `owner`'s, mode 0644, holding
    exactly `data` (links are not followed)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or stat.S_IMODE(st.st_mode) != 0o644:
            return False
        return fh.read(len(data) + 1) == data


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
                signals.kill(int(entry))
                killed.append(int(entry))
            except (OSError, ValueError):
                continue
    return killed


def driver_of(runtime: Path) -> Path:
    """What a jail runs as its driver: its bytecode where staging compiled it, else its source."""
    compiled = runtime / DRIVER_BYTECODE
    return compiled if compiled.is_file() else runtime / DRIVER
