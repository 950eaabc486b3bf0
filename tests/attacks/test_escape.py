"""Escape: code trying to leave its jail — privileges, kernel interfaces, host paths, links."""

from __future__ import annotations

import base64
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance_client.client import AsyncClient
from tests.attacks.common import SYSCALLS, TOKEN, assert_contained, attack, probe, run
from tests.support import SANDBOX_UIDS, Server

Observe = Callable[[str], None]


@attack(
    "run setuid-root binaries (su, mount, passwd, chfn)",
    "setuid bits grant nothing: the files are owned by an unmapped uid, NoNewPrivs=1, every one fails",
)
async def test_setuid_binaries_grant_no_privileges(target: Server, observe: Observe) -> None:
    code = """
import json, os, stat, subprocess
found = {}
for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
    for name in os.listdir(d):
        p = os.path.join(d, name)
        try:
            st = os.stat(p)
        except OSError:
            continue
        if st.st_mode & stat.S_ISUID:
            found[p] = st.st_uid
tries = {}
for argv in (["su", "-c", "id -u"], ["mount", "-t", "tmpfs", "none", "/tmp"], ["passwd", "-d", "root"], ["chfn", "-f", "x", "root"]):
    r = subprocess.run(argv, capture_output=True, text=True, input="x\\n", timeout=10)
    tries[argv[0]] = [r.returncode, r.stdout.strip()]
print(json.dumps({"owners": found, "tries": tries, "uid": os.getuid(), "euid": os.geteuid()}))
"""
    _, rep = await probe(target, code)
    assert rep["owners"], "expected some setuid binaries to try"
    assert all(uid != 0 for uid in rep["owners"].values()), rep["owners"]
    assert all(rc != 0 and out != "0" for rc, out in rep["tries"].values()), rep["tries"]
    assert rep["uid"] == rep["euid"] and rep["uid"] in SANDBOX_UIDS, rep  # the jail's own uid, never 0
    observe(
        f"{len(rep['owners'])} setuid binaries owned by uid {set(rep['owners'].values())}; "
        f"exit codes { ({k: v[0] for k, v in rep['tries'].items()}) }"
    )


@attack("ptrace(PTRACE_ATTACH) the jail's init", "EPERM (seccomp)")
async def test_ptrace_attach_to_init_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(101, 16, 1, 0, 0)))")
    assert rep["ret"] == -1 and rep["name"] == "EPERM", rep
    observe(f"ptrace -> {rep['name']}")


@attack("ptrace a forked child of its own", "EPERM: no ptrace at all, not even of its own children")
async def test_ptrace_of_an_own_child_is_refused(target: Server, observe: Observe) -> None:
    code = (
        SYSCALLS
        + """
import signal, time
pid = os.fork()
if pid == 0:
    time.sleep(5); os._exit(0)
r = sc(101, 16, pid, 0, 0)
os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
print(json.dumps(r))
"""
    )
    _, rep = await probe(target, code)
    assert rep["name"] == "EPERM", rep
    observe(f"ptrace(ATTACH, child) -> {rep['name']}")


@attack("process_vm_readv on another process", "EPERM (seccomp)")
async def test_process_vm_readv_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(310, 1, 0, 0, 0, 0, 0)))")
    assert rep["name"] == "EPERM", rep
    observe(f"process_vm_readv -> {rep['name']}")


@attack("mount a tmpfs over /tmp", "EPERM")
async def test_mount_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(165, b'none', b'/tmp', b'tmpfs', 0, 0)))")
    assert rep["ret"] == -1 and rep["name"] == "EPERM", rep
    observe(f"mount -> {rep['name']}")


@attack("umount2 the jail's blacklist mounts to uncover host paths", "EPERM")
async def test_umount_of_the_jails_mounts_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(
        target, SYSCALLS + "print(json.dumps([sc(166, p, 2) for p in (b'/etc', b'/tmp', b'/proc')]))"
    )
    assert all(r["ret"] == -1 and r["name"] == "EPERM" for r in rep), rep
    observe("umount2(/etc,/tmp,/proc, MNT_DETACH) -> " + ",".join(r["name"] for r in rep))


@attack("unshare a new user namespace (to become root in it)", "EPERM (--restrict-namespaces)")
async def test_unshare_user_namespace_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(272, 0x10000000)))")
    assert rep["ret"] == -1 and rep["name"] == "EPERM", rep
    observe(f"unshare(CLONE_NEWUSER) -> {rep['name']}")


@attack("unshare mount, network, pid, uts, ipc and cgroup namespaces", "EPERM for each")
async def test_unshare_of_every_other_namespace_is_refused(target: Server, observe: Observe) -> None:
    flags = {
        "NEWNS": 0x20000,
        "NEWNET": 0x40000000,
        "NEWPID": 0x20000000,
        "NEWUTS": 0x4000000,
        "NEWIPC": 0x8000000,
        "NEWCGROUP": 0x2000000,
    }
    code = SYSCALLS + f"print(json.dumps({{k: sc(272, v)['name'] for k, v in {flags!r}.items()}}))"
    _, rep = await probe(target, code)
    assert set(rep.values()) == {"EPERM"}, rep
    observe(f"unshare -> {rep}")


@attack("setns into the init's namespaces via /proc/1/ns", "EPERM or EACCES")
async def test_setns_is_refused(target: Server, observe: Observe) -> None:
    code = (
        SYSCALLS
        + """
out = {}
for ns in ("mnt", "net", "pid", "user"):
    try:
        fd = os.open(f"/proc/1/ns/{ns}", os.O_RDONLY)
    except OSError as e:
        out[ns] = errno.errorcode[e.errno]; continue
    out[ns] = sc(308, fd, 0)["name"]
print(json.dumps(out))
"""
    )
    _, rep = await probe(target, code)
    assert set(rep.values()) <= {"EPERM", "EACCES"}, rep
    observe(f"setns -> {rep}")


@attack("kernel keyrings: keyctl(JOIN_SESSION_KEYRING)", "EPERM (seccomp)")
async def test_keyctl_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(250, 1, 0, 0, 0, 0)))")
    assert rep["name"] == "EPERM", rep
    observe(f"keyctl -> {rep['name']}")


@attack("kernel keyrings: add_key and request_key", "EPERM (seccomp)")
async def test_add_key_and_request_key_are_refused(target: Server, observe: Observe) -> None:
    code = SYSCALLS + "print(json.dumps([sc(248, b'user', b'k', b'v', 1, -3), sc(249, b'user', b'k', 0, 0)]))"
    _, rep = await probe(target, code)
    assert [r["name"] for r in rep] == ["EPERM", "EPERM"], rep
    observe(f"add_key -> {rep[0]['name']}, request_key -> {rep[1]['name']}")


@attack(
    "/proc/1: read the init's environ, root and memory",
    "/proc/1 is the jail's own firejail init; environ/mem/root refused",
)
async def test_proc_1_is_the_jails_own_init_and_is_closed(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os
out = {"cmdline": open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode()}
for name in ("environ", "mem", "root/", "cwd/"):
    try:
        if name.endswith("/"):
            os.listdir("/proc/1/" + name); out[name] = "listed"
        else:
            open("/proc/1/" + name, "rb").read(16); out[name] = "read"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert rep["cmdline"].endswith("firejail"), rep
    assert all(v in ("EACCES", "EPERM") for k, v in rep.items() if k != "cmdline"), rep
    observe(f"pid 1 = {rep['cmdline']}; " + ", ".join(f"{k}: {v}" for k, v in rep.items() if k != "cmdline"))


@attack(
    "/proc/<server pid>: read the server's environ, cmdline and memory",
    "ENOENT: the server is not in the jail's PID namespace",
)
async def test_the_server_process_is_invisible(target: Server, observe: Observe) -> None:
    pid = target.proc.pid
    code = f"""
import errno, json, os
out = {{}}
for name in ("environ", "cmdline", "mem", "status"):
    try:
        open("/proc/{pid}/" + name, "rb").read(16); out[name] = "read"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
out["visible"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert all(rep[k] == "ENOENT" for k in ("environ", "cmdline", "mem", "status")), rep
    assert pid not in rep["visible"] or (pid <= max(rep["visible"]) and len(rep["visible"]) < 10)
    assert len(rep["visible"]) < 10, f"the jail sees too many processes: {rep['visible']}"
    observe(f"/proc/{pid}/*: ENOENT; jail sees pids {rep['visible']}")


@attack(
    "write outside /workspace (/, /etc, /usr, /var/tmp, /opt, /root, /home, /run, the runtime, the venv)",
    "every write refused (EACCES/EROFS/ENOENT)",
)
async def test_paths_outside_the_workspace_are_not_writable(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os, sys
dirs = ["/", "/etc", "/usr", "/usr/local", "/usr/lib", "/var", "/var/tmp", "/opt", "/root", "/home", "/run",
        "/run/firejail", "/srv", "/mnt", "/dev", "/dev/shm", "/sys", "/sys/fs/cgroup", "/proc/sys",
        os.environ["APPLIANCE_RUNTIME"], os.path.dirname(os.path.dirname(sys.executable))]
out = {}
for d in dirs:
    try:
        with open(os.path.join(d, "planted"), "w") as fh:
            fh.write("x")
        out[d] = "WROTE"
    except OSError as e:
        out[d] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    wrote = [d for d, v in rep.items() if v == "WROTE"]
    assert not wrote, f"wrote to {wrote}"
    observe("refused: " + ", ".join(f"{d}={v}" for d, v in rep.items()))


@attack(
    "overwrite the in-jail driver or the Python interpreter",
    "EROFS/EACCES: the runtime and venv are read-only",
)
async def test_the_driver_and_interpreter_cannot_be_replaced(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os, sys
out = {}
for p in (os.path.join(os.environ["APPLIANCE_RUNTIME"], "appliance", "inside", "driver.py"), sys.executable, os.__file__):
    try:
        open(p, "ab").close(); out[p] = "OPENED"
    except OSError as e:
        out[p] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert all(v in ("EROFS", "EACCES", "EPERM") for v in rep.values()), rep
    observe(", ".join(f"{os.path.basename(k)}: {v}" for k, v in rep.items()))


@attack(
    "open raw device nodes (/dev/mem, /dev/kmsg, disks, /dev/fuse, loop) and mknod one",
    "nodes absent (ENOENT) in the private /dev; mknod EPERM",
)
async def test_device_nodes_are_absent_and_cannot_be_made(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os
out = {}
for d in ("/dev/mem", "/dev/kmem", "/dev/port", "/dev/kmsg", "/dev/vda", "/dev/sda", "/dev/fuse", "/dev/loop0",
          "/dev/loop-control", "/dev/net/tun", "/dev/console"):
    try:
        os.close(os.open(d, os.O_RDONLY)); out[d] = "OPENED"
    except OSError as e:
        out[d] = errno.errorcode[e.errno]
try:
    os.mknod("/workspace/mem", 0o20666, os.makedev(1, 1)); out["mknod"] = "MADE"
except OSError as e:
    out["mknod"] = errno.errorcode[e.errno]
out["dev"] = sorted(os.listdir("/dev"))
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    dev = rep.pop("dev")
    assert "OPENED" not in rep.values() and rep["mknod"] == "EPERM", rep
    assert not {"mem", "kmsg", "vda", "sda", "fuse"} & set(dev), dev
    observe(f"/dev holds {dev}; " + ", ".join(f"{k}={v}" for k, v in rep.items()))


@attack(
    "upload through a symlink planted by an earlier cell (session: link -> /etc)",
    "the upload is refused (O_NOFOLLOW), nothing is written through the link",
)
async def test_uploads_never_follow_a_planted_symlink(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        first = await c.execute(
            "import os\nos.symlink('/tmp', 'link')\nos.symlink('/tmp/t', 'file')", session="new"
        )
        assert first.status == "ok", first
        sid = first.session
        via_dir = await c.execute("print('ran')", session=sid, files={"link/x": b"pwn"})
        via_file = await c.execute("print('ran')", session=sid, files={"file": b"pwn"})
        check = await c.execute(
            "import os\nprint(os.path.exists('/tmp/x'), os.path.exists('/tmp/t'))", session=sid
        )
        assert sid is not None
        await c.close_session(sid)
    assert via_dir.status == "error" and via_dir.stdout == "", via_dir
    assert via_file.status == "error" and via_file.stdout == "", via_file
    assert check.stdout == "False False\n", check
    observe(
        f"link/x: {via_dir.error and via_dir.error['evalue']}; file: {via_file.error and via_file.error['evalue']}"
    )


@attack(
    "outputs/ symlink to a host file (/etc/shadow) for the root server to read",
    "no file frame for the link; no host file content reaches the client",
)
async def test_an_output_symlink_to_a_host_file_is_not_read(target: Server, observe: Observe) -> None:
    code = "import os\nos.symlink('/etc/shadow', 'outputs/shadow')\nos.symlink('/etc/hostname', 'outputs/h')\nopen('outputs/ok.txt','w').write('fine')"
    ex = await run(target, code)
    paths = [f["path"] for f in ex.files]
    assert paths == ["ok.txt"], paths
    assert "root:" not in str(ex.frames)
    observe(f"file frames: {paths}")


@attack(
    "outputs/ directory symlink to / (so the server walks the host)",
    "the link is not walked; no file frames from it",
)
async def test_an_output_directory_symlink_is_not_walked(target: Server, observe: Observe) -> None:
    ex = await run(target, "import os\nos.symlink('/', 'outputs/host')\nos.symlink('/etc', 'outputs/etc')")
    assert ex.status == "ok" and ex.files == [], ex.files
    observe("no file frames")


@attack("replace outputs/ itself with a symlink to /etc", "outputs/ is not followed; no file frames")
async def test_outputs_replaced_by_a_symlink_is_not_followed(target: Server, observe: Observe) -> None:
    ex = await run(target, "import os\nos.rmdir('outputs')\nos.symlink('/etc', 'outputs')")
    assert ex.status == "ok" and ex.files == [], ex.files
    observe("no file frames")


@attack(
    "hard link in outputs/ (to its own file and to a root-owned file)",
    "hard link to root's file refused by the kernel; multiply-linked file not sent",
)
async def test_output_hard_links_are_refused(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os, sys
open("secret", "w").write("mine")
os.link("secret", "outputs/linked")
try:
    os.link(sys.executable, "outputs/python"); r = "LINKED"
except OSError as e:
    r = errno.errorcode[e.errno]
print(json.dumps({"root_file": r}))
"""
    ex, rep = await probe(target, code)
    assert rep["root_file"] in ("EPERM", "EXDEV", "EACCES"), rep
    assert ex.files == [], ex.files
    observe(f"link to root's file: {rep['root_file']}; linked own file: not sent")


@attack(
    "FIFO and device-like entries in outputs/ (to hang the root reader)", "skipped; the run ends normally"
)
async def test_a_fifo_in_outputs_does_not_hang_the_server(target: Server, observe: Observe) -> None:
    ex = await run(target, "import os\nos.mkfifo('outputs/pipe')\nos.mkfifo('outputs/pipe2')", timeout=30)
    assert ex.status == "ok" and ex.files == [], ex
    observe(f"status {ex.status}, no file frames, {ex.duration_ms} ms")


@attack("TIOCSTI: push keystrokes into a terminal", "no terminal: ENOTTY on fds 0-2, /dev/tty ENXIO")
async def test_tiocsti_has_no_terminal_to_inject_into(target: Server, observe: Observe) -> None:
    code = """
import errno, fcntl, json, os, termios
out = {}
for fd in (0, 1, 2):
    try:
        fcntl.ioctl(fd, termios.TIOCSTI, b"x"); out[fd] = "INJECTED"
    except OSError as e:
        out[fd] = errno.errorcode[e.errno]
try:
    fd = os.open("/dev/tty", os.O_RDWR); fcntl.ioctl(fd, termios.TIOCSTI, b"x"); out["tty"] = "INJECTED"
except OSError as e:
    out["tty"] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert "INJECTED" not in rep.values(), rep
    observe(str(rep))


@attack(
    "core dump of a crashing process (raise RLIMIT_CORE, SIGSEGV)",
    "RLIMIT_CORE is 0/0 and cannot be raised; no core file is written",
)
async def test_core_dumps_are_disabled(target: Server, observe: Observe) -> None:
    code = """
import json, os, resource, signal
out = {"limit": resource.getrlimit(resource.RLIMIT_CORE)}
try:
    resource.setrlimit(resource.RLIMIT_CORE, (-1, -1)); out["raise"] = "RAISED"
except (ValueError, OSError) as e:
    out["raise"] = type(e).__name__
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGSEGV)
_, st = os.waitpid(pid, 0)
out["dumped"] = os.WCOREDUMP(st)
out["files"] = os.listdir(".") + os.listdir("/tmp")
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert rep["limit"] == [0, 0] and rep["raise"] != "RAISED" and not rep["dumped"], rep
    assert not any(n.startswith("core") for n in rep["files"]), rep["files"]
    observe(f"RLIMIT_CORE {rep['limit']}, raise -> {rep['raise']}, core dumped: {rep['dumped']}")


@attack(
    "connect to a host abstract-namespace unix socket", "ECONNREFUSED: the jail has its own network namespace"
)
async def test_host_abstract_unix_sockets_are_unreachable(target: Server, observe: Observe) -> None:
    name = f"appliance-attack-{os.getpid()}"
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    host.bind("\0" + name)
    host.listen(1)
    try:
        code = f"""
import errno, json, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect("\\0{name}"); r = "CONNECTED"
except OSError as e:
    r = errno.errorcode[e.errno]
print(json.dumps({{"r": r, "unix": open("/proc/net/unix").read().count("\\n") - 1}}))
"""
        _, rep = await probe(target, code)
    finally:
        host.close()
    assert rep["r"] == "ECONNREFUSED", rep
    observe(f"connect(@{name}) -> {rep['r']}; jail's /proc/net/unix lists {rep['unix']} sockets")


@attack(
    "chroot, setuid(0), setresuid(0) from inside",
    "chroot EPERM; setuid(0)/setresuid(0) fail (EINVAL: uid 0 is not even mapped in the jail); uid stays the jail's own",
)
async def test_chroot_and_setuid_are_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(
        target,
        SYSCALLS
        + "print(json.dumps([sc(161, b'/tmp')['name'], sc(105, 0)['name'], sc(117, 0, 0, 0)['name'], os.getuid(), os.geteuid()]))",
    )
    assert (
        rep[0] == "EPERM"
        and set(rep[1:3]) <= {"EPERM", "EINVAL"}
        and rep[3] == rep[4]
        and rep[3] in SANDBOX_UIDS
    ), rep
    observe(f"chroot/setuid/setresuid -> {rep}")


@attack("load a kernel module (init_module, finit_module)", "EPERM")
async def test_kernel_module_loading_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(
        target, SYSCALLS + "print(json.dumps([sc(175, 0, 0, b'')['name'], sc(313, 0, b'', 0)['name']]))"
    )
    assert rep == ["EPERM", "EPERM"], rep
    observe(f"init_module/finit_module -> {rep}")


@attack("open_by_handle_at (the 'shocker' container escape)", "EPERM")
async def test_open_by_handle_at_is_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(target, SYSCALLS + "print(json.dumps(sc(304, -100, 0, 0)))")
    assert rep["name"] == "EPERM", rep
    observe(f"open_by_handle_at -> {rep['name']}")


@attack("bpf, perf_event_open and userfaultfd (kernel attack surface)", "refused")
async def test_kernel_attack_surface_syscalls_are_refused(target: Server, observe: Observe) -> None:
    _, rep = await probe(
        target,
        SYSCALLS
        + "print(json.dumps({'bpf': sc(321, 0, 0, 0)['name'], 'perf': sc(298, 0, 0, -1, -1, 0)['name'], 'uffd': sc(323, 0)['name']}))",
    )
    assert set(rep.values()) <= {"EPERM", "EACCES", "ENOSYS"}, rep
    observe(str(rep))


@attack("reboot, sethostname, swapon, kexec_load", "EPERM")
async def test_host_administration_syscalls_are_refused(target: Server, observe: Observe) -> None:
    code = (
        SYSCALLS
        + "print(json.dumps([sc(169, 0xfee1dead, 672274793, 0x4321fedc, 0)['name'], sc(170, b'x', 1)['name'], sc(167, b'/tmp/x', 0)['name'], sc(246, 0, 0, 0, 0)['name']]))"
    )
    _, rep = await probe(target, code)
    assert set(rep) == {"EPERM"}, rep
    observe(f"reboot/sethostname/swapon/kexec_load -> {rep}")


@attack("upload a file whose name is a path out of the workspace", "rejected before anything runs")
async def test_upload_paths_that_climb_out_are_rejected(target: Server, observe: Observe) -> None:
    data = base64.b64encode(b"x").decode()
    seen: list[str] = []
    async with AsyncClient(target.url, TOKEN) as c:
        for path in ("../escape", "/etc/passwd", "a/../../b", "x\x00y"):
            frame = {
                "type": "execute",
                "id": f"u{len(seen)}",
                "code": "print('ran')",
                "files": [{"path": path, "data": data}],
            }
            await c.send(frame)
            seen.append(path)
        replies: list[dict[str, Any]] = []
        while len(replies) < len(seen):
            await __import__("asyncio").sleep(0.05)
            replies = [f for f in c.unrouted if f.get("type") == "done"]
    assert [f["status"] for f in replies] == ["rejected"] * len(seen), replies
    observe("; ".join(f["message"] for f in replies))
    await assert_contained(target)


@pytest.fixture(scope="module")
def with_wheelhouse(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    from tests.attacks.conftest import hostile_server
    from tests.test_wheelhouse import build_wheel

    house = tmp_root / "wheelhouse"
    house.mkdir(mode=0o755)
    build_wheel(house, "tinydep", "1.0", "WORD = 'dep'\n")
    srv = hostile_server(tmp_path_factory.mktemp("pip-server"), tmp_root, SANDBOX_WHEELHOUSE=str(house))
    yield srv
    srv.stop()


@attack(
    "%pip install a wheelhouse name by a direct reference to a wheel the code uploaded "
    "(tinydep@file:///workspace/evil.whl), a URL or a path",
    "refused before pip runs (wheelhouse only): the uploaded wheel's code is never installed",
)
@pytest.mark.parametrize(
    "spec",
    [
        "tinydep@file:///workspace/tinydep-9.9-py3-none-any.whl",
        "tinydep @ file:///workspace/tinydep-9.9-py3-none-any.whl",
        "/workspace/tinydep-9.9-py3-none-any.whl",
        "tinydep-9.9-py3-none-any.whl",
    ],
)
async def test_pip_installs_nothing_but_the_wheelhouse(
    with_wheelhouse: Server, spec: str, tmp_path: Path, observe: Observe
) -> None:
    from tests.test_wheelhouse import build_wheel

    evil = build_wheel(tmp_path, "tinydep", "9.9", "WORD = 'PLANTED'\n")
    code = f"%pip install {spec}\nimport tinydep\nprint('word', tinydep.WORD)"
    ex = await run(with_wheelhouse, code, files={evil.name: evil.read_bytes()})
    assert "PLANTED" not in ex.stdout, f"pip installed the uploaded wheel: {ex.stdout[-400:]}"
    said = ex.error.value if ex.error is not None else ""
    assert ex.status == "error" and "direct references, URLs and paths are refused" in said, (ex.status, said)
    observe(f"{spec}: {ex.status}; {said[:200]}")
