"""Exfiltration: code trying to read what is not its own — secrets, other runs, the network."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

from appliance.runtime.canary import ALLOWED_JAIL_ENV
from appliance_client.client import AsyncClient
from tests.attacks.common import AWS_SECRET, TOKEN, attack, probe, run, run_dirs
from tests.support import REPO, Server, run_root, until_async

Observe = Callable[[str], None]

SCAN = """
import json, os
SECRETS = {secrets!r}
hits = []
def scan(path):
    try:
        with open(path, "rb") as fh:
            data = fh.read(1 << 20)
    except OSError:
        return False
    for s in SECRETS:
        if s.encode() in data:
            hits.append(path)
    return True
"""


def scan_code(body: str) -> str:
    return SCAN.format(secrets=[TOKEN, AWS_SECRET]) + body


@attack(
    "read the server's secrets from the jail's environment",
    "the environment holds only the jail's own allow-listed variables; no token, no AWS key",
)
async def test_the_environment_holds_no_server_secret(target: Server, observe: Observe) -> None:
    _, env = await probe(target, "import json, os\nprint(json.dumps(dict(os.environ)))")
    assert set(env) <= ALLOWED_JAIL_ENV, set(env) - ALLOWED_JAIL_ENV
    assert not any(k.startswith(("SANDBOX_", "AWS_")) for k in env)
    observe(f"{len(env)} variables, all allow-listed: {sorted(env)}")


@attack("/proc/*/environ of every visible process", "no secret in any readable environ; others' refused")
async def test_no_process_environ_holds_a_secret(target: Server, observe: Observe) -> None:
    code = scan_code("""
read = [p for p in os.listdir("/proc") if p.isdigit() and scan(f"/proc/{p}/environ")]
print(json.dumps({"hits": hits, "read": read, "pids": [p for p in os.listdir("/proc") if p.isdigit()]}))
""")
    _, rep = await probe(target, code)
    assert rep["hits"] == [], rep
    observe(f"read environ of {len(rep['read'])}/{len(rep['pids'])} visible pids; secrets found: none")


@attack("/proc/*/cmdline of every visible process", "only the jail's own processes; no secret")
async def test_no_process_cmdline_holds_a_secret(target: Server, observe: Observe) -> None:
    code = scan_code("""
cmds = {}
for p in os.listdir("/proc"):
    if p.isdigit() and scan(f"/proc/{p}/cmdline"):
        cmds[p] = open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")[0].decode()
print(json.dumps({"hits": hits, "cmds": cmds}))
""")
    _, rep = await probe(target, code)
    assert rep["hits"] == [], rep
    assert all(c.endswith(("firejail", "python", "python3", "python3.11")) for c in rep["cmds"].values()), rep
    observe(f"visible commands: {sorted(set(rep['cmds'].values()))}; no secret")


@attack(
    "search every readable file (/etc, /tmp, /workspace, /run, /dev/shm, runtime, /proc/self) for the token",
    "the token and the AWS key are in no file the jail can read",
)
async def test_no_readable_file_holds_the_servers_token(target: Server, observe: Observe) -> None:
    code = scan_code("""
import time
n = 0
t = time.time()
for root in ("/etc", "/tmp", "/workspace", "/run", "/dev/shm", os.environ["APPLIANCE_RUNTIME"], "/var", "/proc/self", "/proc/1"):
    for d, dirs, files in os.walk(root):
        for f in files:
            if time.time() - t < 20:
                n += scan(os.path.join(d, f))
print(json.dumps({"hits": hits, "files": n}))
""")
    _, rep = await probe(target, code, timeout=60)
    assert rep["hits"] == [] and rep["files"] > 10, rep
    observe(f"scanned {rep['files']} readable files; secrets found: none")


@attack(
    "the server's token in logs after a wrong-token attempt",
    "401 before upgrade; the token appears in no log line",
)
async def test_the_token_never_reaches_the_log(target: Server, observe: Observe) -> None:
    _status, _ = target.get("/readyz")
    import websockets

    refused = ""
    try:
        async with websockets.connect(target.url, additional_headers={"Authorization": f"Bearer {TOKEN}x"}):
            refused = "UPGRADED"
    except websockets.InvalidStatus as exc:
        refused = str(exc.response.status_code)
    await run(target, "print(1)")
    assert refused == "401", refused
    assert TOKEN not in target.logs() and AWS_SECRET not in target.logs()
    observe(f"wrong token -> HTTP {refused}; token absent from {len(target.logs().splitlines())} log lines")


@attack(
    "read another concurrent run's files by their host path",
    "the other run's directory does not exist in the jail",
)
async def test_another_runs_files_are_out_of_reach(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        victim = asyncio.create_task(
            c.execute("import time\nopen('victim-secret.txt','w').write('VICTIM-DATA-31337')\ntime.sleep(4)")
        )
        base = run_root(Path(target.env["SANDBOX_TMP_ROOT"]), target.proc.pid)
        # A cold jail (no pool here): seconds on a loaded machine.
        found = await until_async(
            lambda: [d for d in run_dirs(target) if (base / d / "victim-secret.txt").exists()],
            30,
            "the victim run wrote its file",
        )
        host_path = str(base / found[0] / "victim-secret.txt")
        code = f"""
import errno, json, os
out = {{}}
for p in ({host_path!r}, {str(base)!r}, {str(base.parent)!r}, "/workspace/../" + {found[0]!r}):
    try:
        out[p] = open(p).read() if p.endswith(".txt") else os.listdir(p)
    except OSError as e:
        out[p] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
        attacker, rep = await probe(target, code)
        await victim
    assert "VICTIM-DATA-31337" not in json.dumps(attacker.frames), rep
    files = {k: v for k, v in rep.items() if not isinstance(v, list)}
    listings = [v for v in rep.values() if isinstance(v, list)]
    assert all(v.startswith("E") for v in files.values()), rep
    assert all(found[0] not in v and not any(n.startswith("srv-") for n in v) for v in listings), rep
    observe(", ".join(f"{os.path.basename(k) or k}: {v}" for k, v in rep.items()))


@attack(
    "read another session's files and variables from a one-shot run and from a second session",
    "each jail sees only its own fresh /workspace and /tmp",
)
async def test_another_sessions_files_and_state_are_out_of_reach(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        victim = await c.execute(
            "SECRET='SESSION-SECRET-4242'\nopen('s.txt','w').write(SECRET)\n"
            "open('/tmp/s.txt','w').write(SECRET)",
            session="new",
        )
        assert victim.status == "ok"
        look = (
            "import json, os\nprint(json.dumps({'ws': sorted(os.listdir('.')), 'tmp': sorted(os.listdir('/tmp')),"
            " 'var': globals().get('SECRET')}))"
        )
        _, one_shot = await probe(target, look)
        other = await c.execute(look, session="new")
        again = await c.execute("print(SECRET)", session=victim.session)
        assert victim.session is not None
        await c.close_session(victim.session)
        assert other.session is not None
        await c.close_session(other.session)
    rep2 = json.loads(other.stdout)
    for rep in (one_shot, rep2):
        assert "s.txt" not in rep["ws"] and "s.txt" not in rep["tmp"] and rep["var"] is None, rep
    assert again.stdout == "SESSION-SECRET-4242\n"
    observe(f"one-shot saw ws={one_shot['ws']} tmp={one_shot['tmp']}; other session saw ws={rep2['ws']}")


@attack(
    "read another run's memory (/proc/<pid>/mem of every visible process)",
    "only the jail's own processes are visible; the victim's secret is never read",
)
async def test_another_runs_memory_is_out_of_reach(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        victim = asyncio.create_task(
            c.execute(
                "import time\nsecret = 'MEMORY-SECRET-' + 'abc123' * 3\nprint('ready', flush=True)\ntime.sleep(4)"
            )
        )
        await asyncio.sleep(1.0)
        code = """
import errno, json, os, re
found, out = [], {}
for p in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        maps = open(f"/proc/{p}/maps").read().splitlines()
        mem = open(f"/proc/{p}/mem", "rb", buffering=0)
    except OSError as e:
        out[p] = errno.errorcode[e.errno]; continue
    out[p] = "open"
    for line in maps:
        if "rw-p" not in line:
            continue
        a, b = (int(x, 16) for x in line.split()[0].split("-"))
        try:
            mem.seek(a); chunk = mem.read(min(b - a, 1 << 24))
        except (OSError, ValueError, OverflowError):
            continue
        if b"MEMORY-SECRET-abc123abc123abc123" in chunk:
            found.append(p)
print(json.dumps({"found": found, "procs": out}))
"""
        _, rep = await probe(target, code)
        await victim
    # The attacker's own code holds the needle text once: only its own pid may match.
    own = [p for p, v in rep["procs"].items() if v == "open"]
    assert set(rep["found"]) <= set(own) and len(rep["procs"]) < 10, rep
    observe(f"visible pids {sorted(rep['procs'])} (own jail only); needle found only in its own memory")


@attack(
    "leftovers of an earlier run (files in /workspace and /tmp)",
    "a fresh run starts with an empty workspace and /tmp",
)
async def test_a_new_run_sees_nothing_of_the_previous_one(target: Server, observe: Observe) -> None:
    await run(target, "open('left.txt','w').write('x')\nopen('/tmp/left.txt','w').write('x')")
    _, rep = await probe(
        target, "import json, os\nprint(json.dumps([sorted(os.listdir('.')), sorted(os.listdir('/tmp'))]))"
    )
    assert "left.txt" not in rep[0] and "left.txt" not in rep[1], rep
    observe(f"next run saw workspace {rep[0]} and /tmp {rep[1]}")


@attack(
    "cloud metadata 169.254.169.254:80 (IMDS)",
    "ENETUNREACH at once: no route, no packet leaves the namespace",
)
async def test_cloud_metadata_is_unreachable_without_a_route(target: Server, observe: Observe) -> None:
    code = """
import errno, json, socket, time
s = socket.socket(); s.settimeout(3)
t = time.monotonic()
try:
    s.connect(("169.254.169.254", 80)); r = "CONNECTED"
except OSError as e:
    r = errno.errorcode.get(e.errno, str(e))
ms = (time.monotonic() - t) * 1000
routes = open("/proc/net/route").read().splitlines()[1:]
ifaces = sorted(n for _, n in socket.if_nameindex())
print(json.dumps({"r": r, "ms": ms, "routes": routes, "ifaces": ifaces}))
"""
    _, rep = await probe(target, code)
    assert rep["r"] == "ENETUNREACH" and rep["ms"] < 500, rep
    assert rep["routes"] == [] and rep["ifaces"] == ["lo"], rep
    observe(
        f"connect -> {rep['r']} in {rep['ms']:.2f} ms; routes {rep['routes']}; interfaces {rep['ifaces']}"
    )


@attack("cloud metadata over IPv6 (fd00:ec2::254) and the GCP/Azure names", "unreachable / unresolvable")
async def test_ipv6_metadata_and_metadata_names_are_unreachable(target: Server, observe: Observe) -> None:
    code = """
import errno, json, socket
out = {}
try:
    s = socket.socket(socket.AF_INET6); s.settimeout(2); s.connect(("fd00:ec2::254", 80)); out["v6"] = "CONNECTED"
except OSError as e:
    out["v6"] = errno.errorcode.get(e.errno, str(e))
for name in ("metadata.google.internal", "metadata"):
    try:
        socket.getaddrinfo(name, 80); out[name] = "RESOLVED"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert rep["v6"] in ("ENETUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT") and "RESOLVED" not in rep.values(), (
        rep
    )
    observe(str(rep))


@attack(
    "DNS: resolve a name and send a raw UDP query to 8.8.8.8:53", "no resolver, no route: both fail at once"
)
async def test_dns_resolution_and_raw_dns_queries_fail(target: Server, observe: Observe) -> None:
    code = """
import errno, json, os, socket
out = {"resolv.conf": os.path.exists("/etc/resolv.conf")}
try:
    socket.getaddrinfo("example.com", 443); out["resolve"] = "RESOLVED"
except OSError as e:
    out["resolve"] = type(e).__name__
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    u.sendto(b"\\x12\\x34" + b"\\x00" * 10, ("8.8.8.8", 53)); out["udp"] = "SENT"
except OSError as e:
    out["udp"] = errno.errorcode[e.errno]
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert rep["resolve"] != "RESOLVED" and rep["udp"] == "ENETUNREACH", rep
    observe(str(rep))


@attack("raw and packet sockets (to sniff or forge traffic)", "EPERM: no CAP_NET_RAW")
async def test_raw_and_packet_sockets_are_refused(target: Server, observe: Observe) -> None:
    code = """
import errno, json, socket
out = {}
for name, args in (("raw", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)), ("packet", (17, socket.SOCK_RAW, 0))):
    try:
        socket.socket(*args); out[name] = "OPENED"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e))
print(json.dumps(out))
"""
    _, rep = await probe(target, code)
    assert "OPENED" not in rep.values(), rep
    observe(str(rep))


@attack(
    "reach the appliance itself (or any host service) over loopback",
    "ECONNREFUSED: loopback is the jail's own",
)
async def test_host_services_on_loopback_are_unreachable(target: Server, observe: Observe) -> None:
    code = f"""
import errno, json, socket
out = {{}}
for port in ({target.port}, 22, 80, 5432):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port)); out[port] = "CONNECTED"
    except OSError as e:
        out[port] = errno.errorcode[e.errno]
print(json.dumps({{"out": out, "tcp": len(open("/proc/net/tcp").read().splitlines()) - 1}}))
"""
    _, rep = await probe(target, code)
    assert set(rep["out"].values()) == {"ECONNREFUSED"} and rep["tcp"] == 0, rep
    observe(f"{rep['out']}; /proc/net/tcp lists {rep['tcp']} sockets")


@attack(
    "read host secrets: /etc/shadow, /root, /home, ssh keys, the source tree",
    "EACCES/ENOENT, or an empty blacklist mount, for each; the source tree is not there",
)
async def test_host_secret_files_are_unreadable(target: Server, observe: Observe) -> None:
    repo = str(REPO)
    code = f'''
import errno, json, os
out = {{}}
for p in ("/etc/shadow", "/etc/gshadow", "/root/.ssh/id_rsa", "/root", "/home", "/etc/ssh", "/proc/kcore", "/var/log",
          "/etc/machine-id", "{repo}/appliance", "{repo}/.git", "{repo}/tests", "/work/shared"):
    try:
        if os.path.isdir(p):
            out[p] = "READ" if os.listdir(p) else "empty"  # a blacklisted dir shows up empty
        else:
            out[p] = "READ" if open(p, "rb").read(1) else "empty"
    except OSError as e:
        out[p] = errno.errorcode[e.errno]
print(json.dumps(out))
'''
    _, rep = await probe(target, code)
    assert "READ" not in rep.values(), rep
    observe(str(rep))


@attack("kernel log and syslog (dmesg)", "EPERM")
async def test_kernel_log_is_unreadable(target: Server, observe: Observe) -> None:
    code = """
import ctypes, errno, json
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(4096)
r = libc.syscall(103, 3, buf, 4096)
print(json.dumps({"ret": r, "errno": errno.errorcode.get(ctypes.get_errno(), "0")}))
"""
    _, rep = await probe(target, code)
    assert rep["ret"] == -1 and rep["errno"] == "EPERM", rep
    observe(f"syslog(READ_ALL) -> {rep['errno']}")


@attack(
    "smuggle data out through a session's shared /tmp to a later one-shot run",
    "no shared /tmp: the later run sees nothing",
)
async def test_the_jails_tmp_is_private_per_jail(target: Server, observe: Observe) -> None:
    async with AsyncClient(target.url, TOKEN) as c:
        sess = await c.execute("open('/tmp/drop','w').write('MAILBOX')", session="new")
        ex = await c.execute("import os\nprint(os.path.exists('/tmp/drop'))")
        assert sess.session is not None
        await c.close_session(sess.session)
    assert ex.stdout == "False\n", ex
    observe("a concurrent jail did not see /tmp/drop")
