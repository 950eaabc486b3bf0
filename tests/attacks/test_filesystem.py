"""Filesystem and IPC: what a run leaves in its directory, under outputs/, in System V IPC or
holds open without a name, and what of the host its jail can still read. The root server
must walk and remove any tree the code makes without recursing on its depth or following
its links, bound what it reads back, and leave nothing of a run for the next one."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import websockets

from appliance.runtime.local import ServerStartError
from appliance.sandbox import instance
from appliance_client.client import AsyncClient, Client, Execution
from tests.attacks.common import SYSCALLS, TOKEN, assert_contained, attack, probe, run
from tests.attacks.conftest import hostile_server
from tests.attacks.test_transport import rss_mb
from tests.support import Server, scaled, start_server

Observe = Callable[[str], None]
OUTPUTS_BUDGET = 64 * 1024 * 1024  # SANDBOX_MAX_OUTPUTS_BYTES's default
IPC_KEY = 0x5EC2E7


@pytest.fixture(scope="module")
def outputs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("persisted")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path, outputs_dir: Path) -> Iterator[Server]:
    srv = hostile_server(
        tmp_path_factory.mktemp("fs-server"),
        tmp_root,
        SANDBOX_OUTPUTS_DIR=str(outputs_dir),
        SANDBOX_MAX_FILE_OUT_BYTES=str(8 * 1024 * 1024),
        SANDBOX_MAX_EXEC_MS="15000",
    )
    yield srv
    srv.stop()


DEEP = (
    "import os\n"
    "for i in range(1200):\n"
    "    os.mkdir('d'); os.chdir('d')\n"
    "    with open('f', 'wb') as fh:\n"
    "        fh.write(b'x' * 4096)\n"
    "print('deep')"
)


@attack(
    "a 1200-deep directory tree (mkdir/chdir in a loop) with a file at every level",
    "the run's directory is removed after the run whatever its depth (no RecursionError); the next run works",
)
async def test_a_1200_deep_tree_is_removed_after_the_run(target: Server, observe: Observe) -> None:
    ex = await run(target, DEEP)
    assert ex.status in ("ok", "output_limit"), (ex.status, ex.message)
    note = await assert_contained(target)
    observe(f"run {ex.status} ({ex.message or ex.stdout.strip()}); {note}")


@attack(
    "the same 1200-deep tree made under outputs/",
    "collection never recurses: a clear status (the files within reach come back, the message "
    "says the deeper ones were not read), never `internal`",
)
async def test_a_deep_tree_under_outputs_gives_a_clear_status(target: Server, observe: Observe) -> None:
    ex = await run(target, "import os\nos.chdir('outputs')\n" + DEEP)
    assert ex.status == "output_limit", (ex.status, ex.message)
    assert "deeper than 128 levels" in str(ex.message), ex.message
    note = await assert_contained(target)
    observe(f"{ex.status}: {ex.message}; {len(ex.files)} file frame(s); {note}")


@attack(
    "a 1200-deep tree with files left under SANDBOX_TMP_ROOT by a server that died",
    "the next server on that temp root starts, becomes ready and removes the stale tree",
)
async def test_a_server_starts_over_a_stale_deep_tree(
    tmp_path: Path, tmp_root: Path, observe: Observe
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = (
        tmp_root / "appliance" / instance.name_of(dead.pid, 0, instance.pid_namespace()) / "0123456789abcdef"
    )
    stale.mkdir(parents=True)
    fd = os.open(stale, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1200):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as fh:
                fh.write(b"x" * 1024)
    finally:
        os.close(fd)
    srv = start_server(
        tmp_path / "srv", SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_TMP_ROOT=str(tmp_root), SANDBOX_POOL_SIZE="0"
    )
    try:
        assert srv.proc.poll() is None
        assert not stale.parent.exists(), "the stale run directory is still there"
        ex = await run(srv, "print('up')")
        assert ex.status == "ok" and ex.stdout == "up\n", ex
    finally:
        srv.stop()
    observe("server started, ready, stale 1200-deep tree removed, a run answered")


SPARSE = (
    "import os\nfor i in range(100):\n"
    "    with open(f'outputs/s{i:03}.bin', 'wb') as fh:\n"
    "        fh.truncate(8 * 1024 * 1024)\nprint('sparse')"
)


@attack(
    "100 sparse 8 MiB files in outputs/ (truncate: no disk blocks, 800 MiB claimed)",
    "file frames stop at SANDBOX_MAX_OUTPUTS_BYTES counted in apparent size; the rest is skipped "
    "and `done` says so (files_skipped); server memory bounded; persistence has the same bound",
)
async def test_sparse_outputs_are_bounded_by_the_outputs_budget(
    target: Server, outputs_dir: Path, observe: Observe
) -> None:
    pid = target.proc.pid
    before = rss_mb(pid)
    peak = [before]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_mb(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    sent = files = 0
    done: dict[str, object] = {}
    run_id = ""
    try:
        async with websockets.connect(
            target.url, max_size=None, additional_headers={"Authorization": f"Bearer {TOKEN}"}
        ) as ws:
            await ws.send(json.dumps({"id": "sparse", "code": SPARSE}))
            async with asyncio.timeout(scaled(120)):
                while True:
                    frame = json.loads(await ws.recv())
                    if frame["type"] == "start":
                        run_id = frame["run"]
                    if frame["type"] == "file":
                        files += 1
                        sent += len(base64.b64decode(frame["data"] or ""))
                    if frame["type"] == "done":
                        done = frame
                        break
    finally:
        sampler.cancel()
    persisted = sum(p.stat().st_size for p in outputs_dir.glob(f"*/{run_id}/**/*") if p.is_file())
    grew = peak[0] - before
    assert sent <= OUTPUTS_BUDGET, f"{sent} bytes of file frames were sent"
    assert persisted <= OUTPUTS_BUDGET, f"{persisted} bytes were persisted"
    assert files + int(done.get("files_skipped") or 0) == 100, (files, done)  # type: ignore[call-overload]
    assert done["status"] == "output_limit" and "SANDBOX_MAX_OUTPUTS_BYTES" in str(done["message"]), done
    assert grew < 200, f"server RSS grew by {grew:.0f} MB"
    note = await assert_contained(target)
    observe(
        f"{files} files ({sent >> 20} MiB) sent, {done.get('files_skipped')} skipped, "
        f"{persisted >> 20} MiB persisted; server RSS {before:.0f} -> peak {peak[0]:.0f} MB; {note}"
    )


IPC_MAKE = f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget({IPC_KEY}, 1 << 20, 0o1666)
addr = libc.shmat(shm, None, 0)
secret = b"ipc-secret-of-run-one"
ctypes.memmove(addr, secret, len(secret))
msg = libc.msgget({IPC_KEY}, 0o1666)
sem = libc.semget({IPC_KEY}, 1, 0o1666)
print(json.dumps({{"shm": shm, "msg": msg, "sem": sem}}))
"""
IPC_FIND = f"""
import ctypes, json
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget({IPC_KEY}, 0, 0)
seen = ctypes.string_at(libc.shmat(shm, None, 0), 21).decode(errors="replace") if shm >= 0 else None
print(json.dumps({{"shm": shm, "seen": seen, "msg": libc.msgget({IPC_KEY}, 0), "sem": libc.semget({IPC_KEY}, 0, 0),
                  "sysvipc": open("/proc/sysvipc/shm").read().count("\\n") - 1}}))
"""


def host_ipc_keys() -> set[int]:
    """System V keys the host's own IPC namespace holds (shm, msg, sem), as the server sees them."""
    keys: set[int] = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as fh:
            keys |= {int(line.split()[0]) for line in fh.readlines()[1:] if line.split()}
    return keys


@attack(
    "a run leaves a System V shared memory segment holding a secret (and a queue and a semaphore)",
    "each jail has its own IPC namespace: a later fresh jail finds none of them, and nothing of "
    "them stays on the host after the run",
)
async def test_system_v_ipc_does_not_outlive_its_run(target: Server, observe: Observe) -> None:
    try:
        _, made = await probe(target, IPC_MAKE)
        assert made["shm"] >= 0 and made["msg"] >= 0 and made["sem"] >= 0, made
        await asyncio.sleep(0.5)
        left = IPC_KEY in host_ipc_keys()
        _, found = await probe(target, IPC_FIND)
    finally:
        for flag in ("-M", "-Q", "-S"):  # on a host where the attack worked, clean up after it
            subprocess.run(["ipcrm", flag, str(IPC_KEY)], capture_output=True, check=False)
    assert not left, "the run's IPC objects are still on the host after the run"
    assert found["shm"] == -1 and found["seen"] is None, found
    assert found["msg"] == -1 and found["sem"] == -1, found
    note = await assert_contained(target)
    observe(
        f"later jail: shmget/msgget/semget -1, /proc/sysvipc/shm lists {found['sysvipc']}; "
        f"host holds none of the keys; {note}"
    )


SWAP = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
os.mkdir("x")
os.symlink(HOST, "y")
end = time.monotonic() + 4
swaps = 0
while time.monotonic() < end:
    if libc.renameat2(-100, b"x", -100, b"y", 2) != 0:  # AT_FDCWD, RENAME_EXCHANGE
        raise OSError(ctypes.get_errno(), "renameat2")
    swaps += 1
print("swapped", swaps)
"""


@attack(
    "swap a directory with a symlink to a host directory in a tight renameat2(RENAME_EXCHANGE) loop",
    "the disk watchdog walks by directory descriptor with O_NOFOLLOW: it never lists the host "
    "directory (whose 100 MiB would put the run over its quota), the run ends ok",
)
async def test_a_symlink_swap_cannot_make_the_watchdog_list_the_host(
    target: Server, tmp_root: Path, observe: Observe
) -> None:
    host = tmp_root / "host-only"
    host.mkdir(exist_ok=True)
    with open(host / "big.bin", "wb") as fh:  # allocated blocks on the run directories' filesystem
        os.posix_fallocate(fh.fileno(), 0, 100 * 1024 * 1024)
    try:
        ex = await run(target, f"HOST = {str(host)!r}\n" + SWAP)
    finally:
        (host / "big.bin").unlink()
    assert ex.status == "ok" and ex.stdout.startswith("swapped"), (ex.status, ex.message, ex.stderr[-400:])
    note = await assert_contained(target)
    observe(f"run ok after {ex.stdout.split()[-1]} swaps; {note}")


UNNAMED = """
import os, time
fd = os.open("hidden.bin", os.O_CREAT | os.O_RDWR, 0o600)
os.unlink("hidden.bin")
mem = os.memfd_create("hidden")
block = b"u" * (1 << 20)
for _ in range(45):
    os.write(fd, block)
    os.write(mem, block)
time.sleep(4)
print("kept", os.fstat(fd).st_size + os.fstat(mem).st_size)
"""


@attack(
    "write 45 MiB to an unlinked-but-open file and 45 MiB to a memfd (quota 64 MiB)",
    "files held open with no name count toward SANDBOX_MAX_DISK_MB: output_limit",
)
async def test_unlinked_files_and_memfds_count_toward_the_disk_quota(
    target: Server, observe: Observe
) -> None:
    ex = await run(target, UNNAMED)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(ex.message), (ex.status, ex.message)
    note = await assert_contained(target)
    observe(f"{ex.status}: {ex.message}; {note}")


async def next_cell_after(target: Server, code: str) -> Execution:
    """Open a session with `code` (its cell must end ok), wait while its jail is frozen between
    cells, then send a next cell that runs long enough for what the first left behind to
    thaw and do its work: what that cell got."""
    async with AsyncClient(target.url, TOKEN) as client:
        first = await client.execute(code, session="new")
        assert first.status == "ok", first
        await asyncio.sleep(scaled(2))
        return await client.execute("import time; time.sleep(3); print('still?')", session=first.session)


@attack(
    "a session's cell leaves a thread that fills a memfd after the cell ended (90 MiB, quota 64)",
    "between cells the thread is frozen; once thawed by the next cell it fills the memfd there, and "
    "the quota holds at that cell's end, memfds included: output_limit",
)
async def test_a_sessions_memfd_counts_between_cells(target: Server, observe: Observe) -> None:
    later = await next_cell_after(
        target,
        "import os, threading, time\n"
        "held = []\n"
        "def fill():\n"
        "    time.sleep(0.5)\n"
        "    fd = os.memfd_create('between'); held.append(fd)\n"
        "    for _ in range(90):\n"
        "        os.write(fd, b'm' * (1 << 20))\n"
        "threading.Thread(target=fill, daemon=True).start()\nprint('started')",
    )
    assert later.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(later.message), (
        later.status,
        later.message,
    )
    note = await assert_contained(target)
    observe(f"next request: {later.status} ({later.message}); {note}")


OWN_TABLE = """
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
held = threading.Event()
def hold():
    if libc.unshare(0x400) != 0:  # CLONE_FILES: a descriptor table of this thread's own
        raise OSError(ctypes.get_errno(), "unshare")
    fd = os.open("hidden.bin", os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink("hidden.bin")
    try:
        for _ in range(90):
            os.write(fd, b"t" * (1 << 20))
    except OSError:  # ENOSPC just past the quota: the run's tmpfs is sized (`runfs`)
        pass
    held.set()
    threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
print("held", flush=True)
"""


@attack(
    "a thread unshares its descriptor table (CLONE_FILES) and holds a 90 MiB unlinked file there "
    "(quota 64 MiB), in a one-shot run and across a session's cells",
    "every descriptor table is searched: output_limit for the run, and for the session's next cell, "
    "where the thawed thread fills the file",
)
async def test_a_file_held_in_a_threads_own_descriptor_table_counts(target: Server, observe: Observe) -> None:
    ex = await run(target, OWN_TABLE)
    assert ex.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(ex.message), (ex.status, ex.message)
    # The first cell ends over the quota too; a cell that stays within it leaves a thread that
    # fills the file once the next cell thaws the session.
    later = await next_cell_after(
        target,
        OWN_TABLE.replace("held.wait()", "")
        .replace("held.set()", "")
        .replace("def hold():", "def hold():\n    import time; time.sleep(0.5)"),
    )
    assert later.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(later.message), (
        later.status,
        later.message,
    )
    note = await assert_contained(target)
    observe(
        f"one-shot: {ex.status} ({ex.message}); next session cell: {later.status} ({later.message}); {note}"
    )


@attack(
    "io_uring_setup (syscall 425) from ctypes",
    "refused by the jail's seccomp filter (EPERM or ENOSYS): no io_uring instance",
)
async def test_io_uring_is_refused(target: Server, observe: Observe) -> None:
    _, out = await probe(
        target,
        SYSCALLS + "buf = ctypes.create_string_buffer(120)\n"
        "print(json.dumps(sc(425, 4, ctypes.addressof(buf))))",
    )
    assert out["ret"] == -1 and out["name"] in ("EPERM", "ENOSYS"), out
    observe(f"io_uring_setup -> {out['ret']} {out['name']}")


@attack(
    "read /etc/passwd and /etc/group in the jail for the host's accounts",
    "the jail's passwd and group list only root and the sandbox user",
)
async def test_the_jail_lists_no_host_account(target: Server, observe: Observe) -> None:
    import pwd

    _, out = await probe(
        target,
        "import json\n"
        "names = lambda p: sorted(l.split(':')[0] for l in open(p) if l.strip())\n"
        "print(json.dumps({'passwd': names('/etc/passwd'), 'group': names('/etc/group')}))",
    )
    sandbox = pwd.getpwuid(1001).pw_name
    assert out["passwd"] == sorted(["root", sandbox]), out
    assert len(out["group"]) == 2 and "root" in out["group"], out
    observe(f"passwd: {out['passwd']}; group: {out['group']}")


# -- a local user squats the temp root (issue 28, item 2) -------------------------------------
SQUATTER = 65534  # nobody: any local account that can write in a shared temp root


def _squat(root: Path) -> Path:
    """What a local user does before the server first starts: make `<root>/appliance` their own."""
    base = root / "appliance"
    base.mkdir(mode=0o755)
    os.chown(base, SQUATTER, SQUATTER)
    return base


def _plant_runtime(base: Path, scratch: Path) -> None:
    """A runtime where the server would stage its own (the name is a hash of public source), its
    driver writing outputs/PLANTED in front of every cell."""
    from appliance.sandbox.workdir import stage_runtime

    real = stage_runtime(scratch, Path(sys.executable))  # the name this server computes
    planted = base / real.name
    shutil.copytree(real, planted)
    driver = planted / "appliance" / "inside" / "driver.py"
    source = driver.read_text()
    head = "from __future__ import annotations\n"
    driver.write_text(
        source.replace(head, head + "open('/workspace/outputs/PLANTED', 'w').write('planted')\n", 1)
    )
    for path in (planted, *planted.rglob("*")):
        os.chown(path, SQUATTER, SQUATTER, follow_symlinks=False)


def _plant_link(base: Path, name: str, decoy: Path) -> None:
    decoy.mkdir(mode=0o755)
    os.chown(decoy, SQUATTER, SQUATTER)
    (base / name).symlink_to(decoy)
    os.chown(base / name, SQUATTER, SQUATTER, follow_symlinks=False)


# The server's own instance directory is named by its PID namespace, PID and start time: a
# wrapper that plants a link under that name and then execs the server is what a squatter
# racing a restart achieves.
PLANT_INSTANCE = (
    'ln -s "$1" "$2/srv-$(stat -L -c %i /proc/self/ns/pid)-$$-$(cut -d" " -f22 /proc/$$/stat)"; '
    'shift 2; exec "$@"'
)


@attack(
    "a local user makes <SANDBOX_TMP_ROOT>/appliance first and plants a runtime (driver.py + ready), "
    "a link for the jails' accounts directory or for the server's own srv-* directory",
    "startup stops (exit 2) naming the directory and the fix; the planted driver never runs and "
    "nothing is written through the links",
)
@pytest.mark.parametrize("plant", ["runtime", "accounts", "instance"])
def test_a_squatted_temp_root_stops_startup(
    plant: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, observe: Observe
) -> None:
    from tests.support import reachable_tmp_root

    with reachable_tmp_root("appliance-squat-") as root, reachable_tmp_root("appliance-scratch-") as scratch:
        base = _squat(root)
        decoy = root / "decoy"
        wrap: list[str] = []
        if plant == "runtime":
            _plant_runtime(base, scratch)
        elif plant == "accounts":
            _plant_link(base, "accounts-1001-1001", decoy)
        else:
            _plant_link(base, "placeholder", decoy)
            (base / "placeholder").unlink()
            wrap = ["sh", "-c", PLANT_INSTANCE, "sh", str(decoy), str(base)]
        try:
            srv = start_server(tmp_path, wrap=wrap, SANDBOX_TMP_ROOT=str(root), SANDBOX_POOL_SIZE="0")
        except ServerStartError as exc:
            refusal = str(exc)
        else:
            try:  # the server took the squatted directory: show what the plant achieved
                with Client(srv.url) as client:
                    ex = client.execute("print('tenant')")
                planted = [f.path for f in ex.files]
            finally:
                srv.stop()
            pytest.fail(
                f"the server started on a temp root owned by uid {SQUATTER}: files of a tenant's run "
                f"{planted}, written through the link: {sorted(p.name for p in decoy.glob('*'))}"
            )
        assert "server exited 2" in refusal, refusal
        assert f"{base} is owned by uid {SQUATTER}" in refusal and f"rm -rf {base}" in refusal, refusal
        if plant != "runtime":
            assert not list(decoy.iterdir()), "the server wrote through a planted link"
            assert stat.S_IMODE(decoy.stat().st_mode) == 0o755, "the server changed a planted link's target"
        observe(refusal.splitlines()[-1][:300])


# The jails' prepared /etc (issue 32): bound over every jail's /etc, so a tree planted at its
# path would be every tenant's /etc. The wrapper makes the server's own instance directory as
# root would and plants a link for the /etc in it, then execs the server.
PLANT_ETC = (
    'd="$2/srv-$(stat -L -c %i /proc/self/ns/pid)-$$-$(cut -d" " -f22 /proc/$$/stat)"; '
    'mkdir -m 711 "$d" && ln -s "$1" "$d/etc" && shift 2 && exec "$@"'
)


@attack(
    "a link (to a tree of the attacker's) planted where the server prepares the jails' /etc",
    "startup stops (exit 2) naming the path; nothing is written through the link and no jail starts",
)
def test_a_planted_prepared_etc_stops_startup(tmp_path: Path, observe: Observe) -> None:
    from tests.support import reachable_tmp_root

    with reachable_tmp_root("appliance-etc-squat-") as root:
        base = root / "appliance"
        base.mkdir(mode=0o755)
        decoy = root / "decoy"
        _plant_link(base, "placeholder", decoy)
        (base / "placeholder").unlink()
        (decoy / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        wrap = ["sh", "-c", PLANT_ETC, "sh", str(decoy), str(base)]
        try:
            srv = start_server(tmp_path, wrap=wrap, SANDBOX_TMP_ROOT=str(root), SANDBOX_POOL_SIZE="0")
        except ServerStartError as exc:
            refusal = str(exc)
        else:
            srv.stop()
            pytest.fail("the server started with a planted /etc for its jails")
        assert "server exited 2" in refusal and "/etc exists before the server made it" in refusal, refusal
        assert sorted(p.name for p in decoy.iterdir()) == ["passwd"], "the server wrote through the link"
        observe(refusal.splitlines()[-1][:300])


def test_the_planted_runtime_name_is_the_servers_own(tmp_path: Path) -> None:
    """The name the squatting test plants under is the one a clean server stages: the planting is real."""
    from tests.support import reachable_tmp_root

    with reachable_tmp_root("appliance-clean-") as root, reachable_tmp_root("appliance-scratch-") as scratch:
        from appliance.sandbox.workdir import stage_runtime

        expected = stage_runtime(scratch, Path(sys.executable)).name
        srv = start_server(tmp_path, SANDBOX_TMP_ROOT=str(root), SANDBOX_POOL_SIZE="0")
        try:
            staged = sorted(p.name for p in (root / "appliance").glob("runtime-*"))
        finally:
            srv.stop()
        assert staged == [expected], (staged, expected)


MANY_ENTRIES = """
import os
for i in range(3000):
    os.mkdir(f'outputs/d{i}')
    open(f'outputs/d{i}/f', 'w').close()
print('made')
"""


@attack(
    "3000 directories under outputs/, one empty file in each: 6000 entries that cost 0 bytes",
    "every file and directory costs at least a block of SANDBOX_MAX_OUTPUTS_BYTES and their number is "
    "capped by SANDBOX_MAX_OUTPUT_FILES (1000): output_limit, the rest skipped, at most 1000 entries "
    "persisted, each tenant's in a 0700 directory of its own",
)
async def test_many_empty_outputs_cost_at_least_a_block_each(
    target: Server, outputs_dir: Path, observe: Observe
) -> None:
    ex = await run(target, MANY_ENTRIES)
    done = ex.frames[-1]
    assert ex.run is not None
    persisted = [p for p in outputs_dir.glob(f"*/{ex.run}/**/*")]
    assert len(ex.files) <= 1000 and len(persisted) <= 1000, (len(ex.files), len(persisted))
    assert done["status"] == "output_limit" and int(done.get("files_skipped") or 0) > 0, done
    assert len(ex.files) + int(done.get("files_skipped") or 0) == 3000, done
    tenants = {p.relative_to(outputs_dir).parts[0] for p in outputs_dir.glob(f"*/{ex.run}")}
    assert len(tenants) == 1 and stat.S_IMODE((outputs_dir / tenants.pop()).stat().st_mode) == 0o700
    observe(
        f"{len(ex.files)} file frames, {len(persisted)} entries persisted, {done['files_skipped']} skipped"
    )


IN_FLIGHT_QUOTA_MB = 50
# Issue 28's recipe: files written, unlinked, their descriptors sent over a socketpair kept
# in a global (SCM_RIGHTS) and closed: then no process holds them and no name leads to them.
IN_FLIGHT = """
import errno, json, os, socket
pair = socket.socketpair()
written, error, block = 0, None, b"d" * (1 << 20)
os.chdir({where!r})
for i in range(25):
    fd = os.open(f"f{{i}}", os.O_CREAT | os.O_RDWR, 0o600)
    os.unlink(f"f{{i}}")
    try:
        for _ in range(40):
            n = os.write(fd, block)
            written += n
            if n < len(block):
                raise OSError(errno.ENOSPC, "short write")
    except OSError as exc:
        error = errno.errorcode.get(exc.errno, str(exc.errno))
    socket.send_fds(pair[0], [b"f"], [fd])
    os.close(fd)
    if error:
        break
print(json.dumps({{"written_mib": written >> 20, "error": error}}), flush=True)
"""


@pytest.fixture(scope="module")
def quota_50(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    srv = hostile_server(
        tmp_path_factory.mktemp("in-flight-server"),
        tmp_root,
        SANDBOX_MAX_DISK_MB=str(IN_FLIGHT_QUOTA_MB),
        SANDBOX_MAX_EXEC_MS="30000",
    )
    yield srv
    srv.stop()


@attack(
    f"a session cell writes 25 files of 40 MiB (SANDBOX_MAX_DISK_MB={IN_FLIGHT_QUOTA_MB}), unlinks each and "
    "keeps its descriptor in flight (SCM_RIGHTS over a socketpair held in a global), in /workspace and in /tmp",
    "the kernel refuses the write past the quota (ENOSPC: the run's tmpfs is sized), the cell ends "
    "output_limit, and the session's tmpfs is unmounted and removed when it ends",
)
@pytest.mark.parametrize("where", ["/workspace", "/tmp"])
async def test_files_held_only_in_flight_cannot_pass_the_disk_quota(
    quota_50: Server, observe: Observe, where: str
) -> None:
    from appliance.sandbox import runfs
    from tests.support import run_root

    async with AsyncClient(quota_50.url, TOKEN) as client:
        first = await asyncio.wait_for(
            client.execute(IN_FLIGHT.format(where=where), session="new"), scaled(120)
        )
        after = await asyncio.wait_for(client.execute("print('next')", session=first.session), scaled(60))
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("{")]
    assert lines, (first.status, first.message, first.stderr[-800:])
    report = json.loads(lines[-1])
    # The kernel stops the writer just past the quota (the tmpfs holds the quota + 1 MiB) ...
    assert report["error"] == "ENOSPC" and report["written_mib"] <= IN_FLIGHT_QUOTA_MB + 1, report
    # ... and the server's check, counting the tmpfs's pages, sees the run over it.
    assert first.status == "output_limit" and "SANDBOX_MAX_DISK_MB" in str(first.message), first
    root = run_root(Path(quota_50.env["SANDBOX_TMP_ROOT"]), quota_50.proc.pid)
    deadline = asyncio.get_running_loop().time() + scaled(15)
    while (left := runfs.mounts_under(root)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)  # the session's jail is destroyed after its last done
    assert left == [], f"run tmpfs still mounted: {left}"
    note = await assert_contained(quota_50)
    observe(f"{where}: {report}; cell {first.status}; next request {after.status}; no mount left; {note}")


# -- SandboxFusion's file names (/run_code: `files` in, `fetch_files` out) -------------------------
CLIMBING = ["../escape.txt", "/etc/cron.d/escape", "in/../../escape.txt", "a\x00b"]


def fusion(
    target: Server, body: Mapping[str, object], path: str = "/run_code"
) -> tuple[int, dict[str, object]]:
    """POST to SandboxFusion's route as its clients do, the token as an HTTP Basic password."""
    auth = "Basic " + base64.b64encode(f"trainer:{TOKEN}".encode()).decode()
    status, text = target.request(
        "POST", path, body=body, timeout=scaled(60), headers={"Authorization": auth}
    )
    return status, json.loads(text)


@attack(
    "SandboxFusion file names that are absolute, climb out or hold a NUL, in `files` and in `fetch_files`",
    "400 with a SandboxError naming the refused name before any jail is used; the next run works",
)
async def test_fusion_file_names_that_climb_out_are_refused(target: Server, observe: Observe) -> None:
    seen = []
    for name in CLIMBING:
        for body in (
            {"code": "print(1)", "language": "python", "files": {name: base64.b64encode(b"x").decode()}},
            {"code": "print(1)", "language": "python", "fetch_files": ["ok.txt", name]},
        ):
            status, answer = await asyncio.to_thread(fusion, target, body)
            field = "file name" if "files" in body else "fetch_files entry"
            assert status == 400, (name, status, answer)
            assert answer["status"] == "SandboxError", answer
            assert f"{field} {name!r} is refused" in str(answer["message"]), answer
            seen.append(status)
    note = await assert_contained(target)
    observe(f"{len(seen)} requests, all 400 SandboxError naming the name; {note}")


@attack(
    "a program plants links where /run_code's fetch reads (a file linked to /etc/passwd and /proc/self/environ, "
    "and outputs/.fusion-fetch itself linked to /tmp), then asks for them in `fetch_files`",
    "no link is followed: the linked names are left out of `files`, the regular file comes back, nothing is "
    "read through the links on the host, and the next run works",
)
async def test_fusion_fetch_follows_no_link(target: Server, observe: Observe) -> None:
    code = (
        "import os\n"
        "os.symlink('/etc/passwd', 'passwd')\n"
        "os.symlink('/proc/self/environ', 'environ')\n"
        "os.makedirs('real', exist_ok=True)\n"
        "os.symlink('real', 'dirlink')\n"
        "open('real/plain.txt', 'w').write('plain')\n"
        "os.makedirs('outputs', exist_ok=True)\n"
        "os.symlink('/tmp', 'outputs/.fusion-fetch')\n"
    )
    body = {
        "code": code,
        "language": "python",
        "fetch_files": ["passwd", "environ", "dirlink/plain.txt", "real/plain.txt"],
    }
    status, answer = await asyncio.to_thread(fusion, target, body)
    assert status == 200, answer
    files = answer["files"]
    assert isinstance(files, dict)
    # outputs/.fusion-fetch is the program's link: the server reads no file through it.
    assert files == {}, files
    planted_dir = {**body, "code": code.replace("os.symlink('/tmp', 'outputs/.fusion-fetch')\n", "")}
    status, answer = await asyncio.to_thread(fusion, target, planted_dir)
    assert status == 200, answer
    assert answer["files"] == {"real/plain.txt": base64.b64encode(b"plain").decode()}, answer
    note = await assert_contained(target)
    observe(f"planted fetch dir: no files; plain tree: only real/plain.txt came back; {note}")


# A program that plants a link to /etc/shadow, a link to /etc on the way and a FIFO, writes a
# file of its own, then ignores the interrupt of its time limit: its jail ends with the run, so
# `fetch_files` (PLANTED) are read from the host (appliance/api/fusion/salvage.py).
PLANT_AND_HANG = (
    "import os, time\n"
    "os.symlink('/etc/shadow', 'shadow.txt')\n"
    "os.symlink('/etc', 'etc')\n"
    "os.mkfifo('pipe.txt')\n"
    "open('mine.txt', 'w').write('mine')\n"
    "while True:\n"
    "    try:\n"
    "        time.sleep(60)\n"
    "    except KeyboardInterrupt:\n"
    "        pass\n"
)
PLANTED = ["shadow.txt", "etc/shadow", "pipe.txt", "mine.txt"]


async def assert_only_mine_fetched(target: Server, answer: dict[str, object]) -> str:
    """Only the program's own file came back, each planted name is named, the server is whole."""
    assert answer["files"] == {"mine.txt": base64.b64encode(b"mine").decode()}, answer
    for name in PLANTED[:3]:
        assert f"{name!r} not fetched" in str(answer["message"]), answer["message"]
    return f"only mine.txt came back; {answer['message']}; {await assert_contained(target)}"


@attack(
    "a program plants a link to /etc/shadow, a link to /etc on the way and a FIFO, then ignores the "
    "interrupt of its time limit, so its jail ends with the run and /run_code reads `fetch_files` "
    "from the host",
    "TimeLimitExceeded; no link is followed and the FIFO does not block: only the program's own "
    "file comes back, the others are named in `message`, and the next run works",
)
async def test_fusion_fetch_after_a_time_limit_follows_no_link(target: Server, observe: Observe) -> None:
    body = {"code": PLANT_AND_HANG, "language": "python", "run_timeout": 1, "fetch_files": PLANTED}
    status, answer = await asyncio.to_thread(fusion, target, body)
    assert status == 200, answer
    run_result = answer["run_result"]
    assert isinstance(run_result, dict) and run_result["status"] == "TimeLimitExceeded", answer
    observe(f"after the time limit {await assert_only_mine_fetched(target, answer)}")


@attack(
    "a /run_jupyter cell plants a link to /etc/shadow, a link to /etc on the way and a FIFO, then "
    "ignores the interrupt of its cell time limit, so the kernel's jail ends with the cell and "
    "`fetch_files` are read from the host",
    "Failed with driver TimeLimitExceeded; no link is followed and the FIFO does not block: only the "
    "cell's own file comes back, the others are named in `message`, and the next run works",
)
async def test_fusion_jupyter_fetch_after_a_cell_time_limit_follows_no_link(
    target: Server, observe: Observe
) -> None:
    body = {"cells": [PLANT_AND_HANG], "cell_timeout": 1, "kernel": "python3", "fetch_files": PLANTED}
    status, answer = await asyncio.to_thread(fusion, target, body, "/run_jupyter")
    assert status == 200, answer
    driver = answer["driver"]
    assert answer["status"] == "Failed", answer
    assert isinstance(driver, dict) and driver["status"] == "TimeLimitExceeded", answer
    observe(f"after the cell's time limit {await assert_only_mine_fetched(target, answer)}")
