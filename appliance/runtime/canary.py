"""The readiness canary: a probe run in a real jail, and the pure judgement of its report.

`/readyz` stays red until a canary run proves the jail: the right uid, no_new_privs and
seccomp, no /etc/shadow, no server or host reachable (and no metadata address), and an
environment holding nothing of the server's.
"""

from __future__ import annotations

import json
from typing import Any

from appliance.core.domain import File
from appliance.sandbox.egressintercept import TRUST_ENV

PARAMS_FILE = "canary.json"

# Parameters arrive in PARAMS_FILE (uploaded with the run), never spliced into the source.
CANARY_CODE = """
import json, os, socket
params = json.load(open("canary.json"))
PORT, HOSTS = params["port"], params["hosts"]
report = {"uid": os.getuid(), "env": sorted(os.environ)}
try:
    open("/etc/shadow").read(); report["shadow"] = "readable"
except OSError:
    report["shadow"] = "denied"
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", PORT)); report["loopback"] = "connected"
except OSError:
    report["loopback"] = "refused"
# Egress mode: the host (its addresses and this jail's gateway) and cloud metadata must stay shut.
targets = [(h, PORT) for h in HOSTS] + [("169.254.169.254", 80)]
with open("/proc/net/route") as fh:
    for line in list(fh)[1:]:
        f = line.split()
        if f[1] == "00000000":
            targets.append((socket.inet_ntoa(bytes.fromhex(f[2])[::-1]), PORT))
report["reached"] = []
for target in targets:
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect(target); report["reached"].append("%s:%d" % target)
    except OSError:
        pass
    s.close()
with open("/proc/self/status") as fh:
    for line in fh:
        k, _, v = line.partition(":")
        if k in ("NoNewPrivs", "Seccomp"):
            report[k] = v.strip()
print(json.dumps(report))
"""


ALLOWED_JAIL_ENV = {
    "HOME",
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "MPLBACKEND",
    "MPLCONFIGDIR",
    "APPLIANCE_RUNTIME",
    "APPLIANCE_PRELOAD",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "NUMEXPR_MAX_THREADS",
    "TMPDIR",
    "container",
    "FIREJAIL_QUIET",
    "SHELL",
    "QT_X11_NO_MITSHM",
    "QML_DISABLE_DISK_CACHE",
    "KDE_FORK_SLAVES",
    "PROMPT_COMMAND",
    "SANDBOX_MODELS_DIR",
    "CUDA_VISIBLE_DEVICES",
    "APPLIANCE_WHEELHOUSE",
    "APPLIANCE_WHEEL_CACHE",  # paths only (appliance.inside.magics)
    # Names mode: the jail's own proxy on its link (appliance.sandbox.network.proxy_env).
    *(f"{k}_proxy" for k in ("http", "https", "no")),
    *(f"{k}_PROXY" for k in ("HTTP", "HTTPS", "NO")),
    # Names mode with secrets: paths of the CA bundle the jail trusts (appliance.sandbox.egressintercept).
    *TRUST_ENV,
}


def params_file(port: int, host_addresses: list[str]) -> File:
    """The canary's parameters: the server's port and the host's addresses (egress mode)."""
    return File(PARAMS_FILE, json.dumps({"port": port, "hosts": host_addresses}).encode())


def judge(status: Any, stdout: str, allowed_uids: set[int]) -> list[str]:
    """Every way the canary's run shows a jail less confined than promised. Pure."""
    if status != "ok":
        return [f"canary run ended {status}"]
    try:
        report = json.loads(stdout)
    except ValueError:
        return ["canary printed no report"]
    found = []
    if report.get("uid") not in allowed_uids:
        found.append(f"canary ran as uid {report.get('uid')}")
    if report.get("shadow") != "denied":
        found.append("canary could read /etc/shadow")
    if report.get("loopback") != "refused":
        found.append("canary reached the server over loopback")
    if report.get("reached") != []:
        found.append(f"canary reached the host or a metadata address: {report.get('reached')}")
    if report.get("NoNewPrivs") != "1" or report.get("Seccomp") != "2":
        found.append("canary is missing no_new_privs or seccomp")
    extra_env = set(report.get("env", [])) - ALLOWED_JAIL_ENV
    if extra_env:
        found.append(f"canary saw unexpected environment variables: {sorted(extra_env)}")
    return found
