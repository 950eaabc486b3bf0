"""The real-GPU acceptance checks: one unattended run, PASS/FAIL/SKIP/INFO per check, JSON + Markdown.

Run by `gpu-acceptance.sh` from the kit `make gpu-kit` builds (docs/gpu.md, "The acceptance
kit"), on a GPU machine as root:

    python -m benchmarks.gpu_acceptance --out DIR [--mps] [--gguf MODEL.gguf] [--wheels DIR]

and, in `make test`, against simulated devices (`--simulate`: the simulated NVML backend, the
simulated MPS daemon standing in for the GPU's memory, the stand-in libcuda built from
tests/stub_libcuda.c and a stand-in nvidia-smi), so that only the hardware is left unknown.

Every check runs real requests against a real appliance (`appliance serve`, real firejail
jails); GPU memory is allocated inside the jails through the CUDA driver API (ctypes against
libcuda: cuInit, cuDevicePrimaryCtxRetain, cuMemAlloc), no torch. A check that cannot run on
this machine is SKIP with its reason, never PASS; a measurement where the appliance promises
nothing is INFO (no verdict). The checks, in order:

  preflight.driver / .mig / .compute_mode / .nvidia_uvm   what nvidia-smi and /dev say
  context         what NVML counts for a jailed run's CUDA context; every later allocation
                  meant to stay within its budget is budget - context - slack
  readyz          /readyz: backend, device UUIDs and totals equal to nvidia-smi's
  jail.visible_device   in a jail, one CUDA device, whose UUID is the grant's
  jail.device_nodes     in a jail, exactly the granted /dev/nvidia* nodes
  watchdog.main_thread / .thread / .subprocess   an over-budget run is stopped (kill latency
                  recorded) while a neighbour run ends ok
  host_memory     a GPU run with more of a mapped file resident than SANDBOX_MEMORY_MB is not
                  killed (inconclusive, FAIL, when the file-backed memory stayed under it)
  reclaim         a large run queued behind a killed one never hits CUDA out-of-memory
  contention      N = 1, 4, 16 of benchmarks/gpu_contention.py's mix without its overrunner:
                  no run within its grant ends out of memory or stopped
  contention.overrun_race   the mix with its overrunners at N = 16: FAIL unless each is stopped;
                  INFO (a measurement): neighbours that ran
                  out of memory before the poll stopped it (polling cannot prevent that)
  llama_offload   llama.cpp offloads to the GPU (only where a CUDA build, --wheels DIR, and a
                  model, --gguf, are at hand)
  mps.host / mps.restored   (--mps) EXCLUSIVE_PROCESS + daemon: refused at startup (or, where
                  jails join MPS, daemon-side limits), and the compute mode put back
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# Room left in a budget beyond the run's CUDA context and its allocation: NVML's rounding,
# and a context that grows a little with the first large allocation.
SLACK_MB = 128
# The context's cost assumed where the `context` check could not measure it: cautious.
GUESS_CONTEXT_MB = 1024
# A measurement, not a verdict: what the kit saw where the appliance promises nothing.
INFO = "INFO"
# What the simulated GPU charges for a CUDA context. A real one's is hundreds of MiB as NVML
# counts it on an H100/H200 (more with the CUDA runtime's libraries loaded); on the GPU the
# kit measures it first (the `context` check) and sizes every allocation by it.
SIM_CONTEXT_MB = 400
# ... give or take: each simulated context costs up to this much more (less than SLACK_MB, which
# allocations sized by the measured context leave free).
SIM_CONTEXT_JITTER_MB = 64
MIN_DRIVER = 550
MIB = 1 << 20
SMI_FIELDS = ("index", "uuid", "name", "memory.total", "driver_version", "mig.mode.current", "compute_mode")

# Inside a jail: the CUDA driver API through ctypes, as llama.cpp's runtime would use it.
CUDA = """
import ctypes, json, os, subprocess, sys, threading, time
cu = ctypes.CDLL(os.environ.get('APPLIANCE_LIBCUDA', 'libcuda.so.1'))
def ctx():
    dev, c = ctypes.c_int(), ctypes.c_void_p()
    for name, rc in (('cuInit', cu.cuInit(0)), ('cuDeviceGet', cu.cuDeviceGet(ctypes.byref(dev), 0)),
                     ('cuDevicePrimaryCtxRetain', cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev)),
                     ('cuCtxSetCurrent', cu.cuCtxSetCurrent(c))):
        if rc == 2:  # CUDA_ERROR_OUT_OF_MEMORY: a context takes device memory too
            raise MemoryError(f'{name} failed with CUDA error 2 (out of memory)')
        if rc != 0:
            raise RuntimeError(f'{name} failed with CUDA error {rc}')
def alloc(mb):
    if mb <= 0:
        return
    ptr = ctypes.c_uint64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mb << 20))
    if rc != 0:
        raise MemoryError(f'cuMemAlloc of {mb} MiB failed with CUDA error {rc} (out of memory)')
def alloc_over(mb):
    # The stamp goes out first: the watchdog may stop the run as soon as the memory is held.
    print('ALLOCATING', time.time(), flush=True)
    alloc(mb)
"""
VISIBLE = (
    CUDA
    + """
n, raw = ctypes.c_int(), ctypes.create_string_buffer(16)
assert cu.cuInit(0) == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0
uuids = []
for i in range(n.value):
    assert cu.cuDeviceGetUuid(raw, i) == 0
    uuids.append(raw.raw.hex())
print(json.dumps({'count': n.value, 'uuids': uuids, 'env': os.environ.get('CUDA_VISIBLE_DEVICES')}))
"""
)
NODES = """
import json, os, re, stat
seen = {}
for name in sorted(os.listdir('/dev')):
    if re.match(r'^(nvidia.*|dri|kfd)$', name):
        mode = os.lstat('/dev/' + name).st_mode
        seen[name] = 'char' if stat.S_ISCHR(mode) else 'dir' if stat.S_ISDIR(mode) else 'other'
print(json.dumps(seen))
"""
# The three ways a run's CUDA context can be created: what NVML reports differs for each.
OVERRUN = {
    "main_thread": "ctx(); alloc_over(MB); time.sleep(HOLD_S)",
    "thread": (
        "def work():\n    ctx(); alloc_over(MB); time.sleep(HOLD_S)\n"
        "t = threading.Thread(target=work); t.start(); t.join()"
    ),
    "subprocess": (
        "child = CUDA_SRC + 'ctx(); alloc_over(MB); time.sleep(HOLD_S)'\n"
        "subprocess.run([sys.executable, '-c', child])"
    ),
}
NEIGHBOUR = "ctx(); alloc(MB); time.sleep(SECS); print('neighbour ok', flush=True)"
# Maps a file the kit wrote into the models directory (read-only in every jail), touches
# every page, and reports the process's resident memory after holding it for some polls.
HOST_MEMORY = """
import mmap
ctx(); alloc(GPU_MB)
path = os.path.join(os.environ['SANDBOX_MODELS_DIR'], NAME)
size = os.path.getsize(path)
with open(path, 'rb') as fh:
    m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
    total = sum(m[i] for i in range(0, size, 4096))
    time.sleep(HOLD_S)
    status = dict(line.split(':', 1) for line in open('/proc/self/status') if line.startswith(('VmRSS', 'RssFile', 'RssAnon')))
    print(json.dumps({k: int(v.split()[0]) // 1024 for k, v in status.items()} | {'touched': total}))
"""
HOST_MEMORY_FILE = "kit-host-memory.bin"
# The cap's other side: a GPU run that owns (anonymous, written) more than SANDBOX_MEMORY_MB must
# be stopped, by the kernel (its memory cgroup) or by the watchdog's reading.
HOST_MEMORY_OWNED = """
ctx(); alloc(GPU_MB)
blob = bytearray(OWN_MB << 20)
blob[::4096] = b'\\1' * len(range(0, len(blob), 4096))  # every page written: owned, resident
print('owned', flush=True)
time.sleep(HOLD_S)
print('still running', flush=True)
"""


def filesystem_of(path: Path) -> str:
    """The type of the filesystem path is on (its longest mount point in /proc/self/mounts)."""
    real, best, kind = str(path.resolve()), "", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


def device_minors(root: Path = Path("/proc/driver/nvidia/gpus")) -> dict[str, int]:
    """GPU UUID -> device minor (/dev/nvidia<minor>), from the driver's per-GPU information
    files ("GPU UUID: GPU-...", "Device Minor: 0")."""
    found: dict[str, int] = {}
    for info in sorted(root.glob("*/information")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            fields = {
                key.strip(): value.strip()
                for key, _, value in (line.partition(":") for line in info.read_text().splitlines())
            }
            found[fields["GPU UUID"]] = int(fields["Device Minor"])
    return found


def server_ids(root: int) -> set[int]:
    """Every process and thread ID under the appliance's process (its jails included): the IDs
    the watchdog matches NVML's against."""
    from appliance.sandbox import proctree

    return proctree.task_ids(set(proctree.tree(root)))


def place_model(src: Path, models: Path) -> Path:
    """--gguf's model in the kit's models directory, readable by the sandbox uid: a hard link
    where the file is already world-readable on the same filesystem, else a copy."""
    dest = models / src.name
    dest.unlink(missing_ok=True)
    if src.stat().st_mode & stat.S_IROTH:
        with contextlib.suppress(OSError):
            os.link(src, dest)
            return dest
    shutil.copyfile(src, dest)
    os.chmod(dest, 0o644)
    return dest


def write_mapped_file(path: Path, size_mb: int) -> None:
    """host_memory's file: size_mb MiB of bytes of value 1, readable by the sandbox uid."""
    block = b"\1" * MIB
    with open(path, "wb") as fh:
        for _ in range(size_mb):
            fh.write(block)
    os.chmod(path, 0o644)


class SimulatedGpuMemory:
    """--simulate: a plain GPU's memory, for the stand-in libcuda (tests/stub_libcuda.c).

    Jails' contexts connect to the unix socket `sim-gpu` next to the stand-in library; each
    allocation is granted up to the device's size (a full device is CUDA out-of-memory) and
    written, per host PID (SO_PEERCRED), into the simulated NVML backend's control file. Like
    a real GPU it frees late: a gone process's memory stays for free_delay_s, listed under the
    ID NVML gave it (the thread that connected, where not the main one). And like a real one,
    a context costs memory of its own before anything is allocated: context_mb, counted in the
    process's usage as NVML counts it (hundreds of MiB on an H100/H200), so a run that
    allocates its whole budget is over it, and a context on a full device is out of memory.

    Not exact either, as a real one is not: each context costs context_mb plus up to
    context_jitter_mb more (what a context costs varies with the libraries a process loads),
    each free comes free_delay_s to free_delay_s * (1 + free_jitter) after the process is gone, and with
    usage_unavailable NVML lists every process without its memory (usedGpuMemory unavailable,
    as under MPS or on some virtualised GPUs), though the device's used memory still counts it.
    pid_offset lists processes under IDs the server cannot match (another PID namespace's)."""

    def __init__(  # noqa: PLR0913 (the fake's settings, injected by each check)
        self,
        libcuda: Path,
        control: Path,
        total_mb: int,
        free_delay_s: float = 1.5,
        context_mb: int = SIM_CONTEXT_MB,
        context_jitter_mb: int = 0,
        free_jitter: float = 0.0,
        usage_unavailable: bool = False,
        pid_offset: int = 0,
    ) -> None:
        import random
        import socket
        import threading

        self.control, self.total = control, total_mb << 20
        self.free_delay_s = free_delay_s
        self.context = context_mb << 20
        self.context_jitter = context_jitter_mb << 20
        self.free_jitter = free_jitter
        self.usage_unavailable = usage_unavailable
        self.pid_offset = pid_offset
        self.random = random.Random()  # noqa: S311 (simulated variation, not a secret)
        self.used: dict[int, int] = {}  # pid -> bytes (live, and freeing)
        self.modes: dict[str, str] = {}  # index -> compute mode (DEFAULT unless set)
        self.contexts: set[int] = set()  # host PIDs holding a live context
        self.lock = threading.Lock()
        self.closed = False
        path = libcuda.parent / "sim-gpu"
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(64)
        self.path = path
        self.write()
        threading.Thread(target=self.accept, daemon=True).start()

    def write(self) -> None:
        # Under the lock, file included: two late frees writing at once shared the .tmp file,
        # and the second one's replace found it gone.
        with self.lock:
            if self.closed:  # a late free after the simulated device (and its directory) went
                return
            # pid_offset: IDs of another PID namespace, as a driver that does not translate them
            # into the caller's gives a server in a container.
            procs = [
                {"pid": pid + self.pid_offset, "gpu": 0, "used_mb": -(-b // MIB)}
                for pid, b in self.used.items()
                if b
            ]
            tmp = self.control.with_suffix(".tmp")
            state: dict[str, Any] = {"processes": procs, "compute_mode": dict(self.modes)}
            if self.usage_unavailable:
                state["usage_unavailable"] = True
            tmp.write_text(json.dumps(state))
            tmp.replace(self.control)

    def accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: Any) -> None:  # noqa: PLR0915 (one request/response loop of the fake's protocol)
        import socket
        import struct
        import threading

        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        peer = pid
        # NVML lists a context under the task that created it (a worker thread's ID where one
        # did), and keeps that ID until the memory is freed, after the process is gone.
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
        except (OSError, ValueError):
            tids = []
        pid = tids[-1] if tids else pid
        mine = 0
        try:
            with conn, conn.makefile("rw", encoding="ascii", newline="\n") as stream:
                for line in stream:
                    verb, _, arg = line.strip().partition(" ")
                    if verb == "gpu":
                        # As the driver: PROHIBITED takes no context; EXCLUSIVE_PROCESS (and the
                        # deprecated EXCLUSIVE_THREAD) one process's at a time. The stand-in
                        # libcuda turns "busy" into CUDA error 46 (CUDA_ERROR_DEVICES_UNAVAILABLE).
                        mode = self.modes.get("0", "DEFAULT")
                        with self.lock:
                            busy = mode == "PROHIBITED" or (
                                mode in ("EXCLUSIVE_PROCESS", "EXCLUSIVE_THREAD")
                                and bool(self.contexts - {peer})
                            )
                            # The context's own memory: the stand-in turns "oom" into CUDA error 2.
                            full = not busy and sum(self.used.values()) + self.context > self.total
                            cost = self.context + self.random.randint(0, self.context_jitter)
                            if not busy and not full:
                                self.contexts.add(peer)
                                mine += cost
                                self.used[pid] = self.used.get(pid, 0) + cost
                        self.write()
                        stream.write("busy\n" if busy else "oom\n" if full else "ok none\n")
                    elif verb == "alloc" and arg.isdigit():
                        with self.lock:
                            ok = sum(self.used.values()) + int(arg) <= self.total
                            if ok:
                                mine += int(arg)
                                self.used[pid] = self.used.get(pid, 0) + int(arg)
                        self.write()
                        stream.write("ok\n" if ok else "oom\n")
                    else:
                        stream.write("error\n")
                    stream.flush()
        except (OSError, ValueError):
            pass
        finally:
            with self.lock:
                self.contexts.discard(peer)

            def free() -> None:
                with self.lock:
                    left = self.used.get(pid, 0) - mine
                    if left > 0:
                        self.used[pid] = left
                    else:
                        self.used.pop(pid, None)
                self.write()

            # Later, never sooner: free_delay_s is the least a test may count on.
            delay = self.free_delay_s * (1 + self.random.uniform(0, self.free_jitter))
            timer = threading.Timer(max(0.0, delay), free)
            timer.daemon = True
            timer.start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Check:
    """One check's outcome."""

    name: str
    status: str
    detail: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


def uuid_bytes(uuid: str) -> str:
    """A device UUID as the 16 bytes (hex) cuDeviceGetUuid returns.

    A real UUID is "GPU-" and 32 hex digits in groups; a simulated one ("GPU-SIM-0") is not hex,
    and its bytes are its text after "GPU-", NUL-padded (tests/stub_libcuda.c)."""
    body = uuid.removeprefix("GPU-").removeprefix("MIG-")
    digits = body.replace("-", "")
    if re.fullmatch(r"[0-9a-fA-F]{32}", digits):
        return digits.lower()
    return body.encode()[:16].ljust(16, b"\0").hex()


async def run_cmd(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """subprocess.run in a thread (the event loop keeps serving the clients), 60 s at most."""

    def go() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(cmd, timeout=60, check=bool(kwargs.pop("check", False)), **kwargs)

    return await asyncio.to_thread(go)


def why(ex: Any) -> str:
    """What a run that did not end ok said: its exception, its message or its stderr's tail."""
    if ex.error is not None:
        return f"{ex.error.name}: {ex.error.value}"[-300:]
    return str(ex.message or ex.stderr or "")[-300:]


def nvidia_smi(cmd: list[str]) -> list[dict[str, str]]:
    """One dict per GPU from `nvidia-smi --query-gpu` (values as nvidia-smi writes them)."""
    out = subprocess.run(
        [*cmd, f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"nvidia-smi failed ({out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
        )
    rows = [
        dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
        for line in out.stdout.splitlines()
        if line.strip()
    ]
    if not rows:
        raise RuntimeError("nvidia-smi lists no GPU")
    return rows


class Kit:
    """The checks, one appliance at a time; results in order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sim = bool(args.simulate)
        self.smi_cmd = args.nvidia_smi.split()
        self.out = Path(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-acceptance-", dir=args.tmp))
        os.chmod(self.work, 0o755)  # the sandbox uid reads the stand-in libcuda and the MPS pipes here
        self.results: list[Check] = []
        self.deadline = time.monotonic() + args.budget_s
        self.gpus: list[dict[str, str]] = []
        self.server: Any = None
        self.margin = 128 if self.sim else 256
        self.memory_mb = 256 if self.sim else 2048  # SANDBOX_MEMORY_MB of the kit's server
        self.total_mb = 0
        self.gpu_memory: SimulatedGpuMemory | None = None
        # What NVML counts for a run's CUDA context beyond what the run allocates: measured by
        # the `context` check (or --context-mb), then every allocation meant to stay within its
        # budget is budget - context - slack. Until measured, a cautious guess.
        self.context_mb = GUESS_CONTEXT_MB
        self.slack_mb = SLACK_MB
        # The models directory the kit's server reads: the kit's own, readable by the sandbox
        # uid; host_memory's mapped file and --gguf's model are placed here. Not on a tmpfs
        # (a /tmp that is one): a mapped tmpfs file is shared memory, not file-backed, and the
        # watchdog rightly counts shared memory. Then next to the kit's venv, which the
        # sandbox uid can reach (gpu-acceptance.sh checks).
        base = self.work
        if filesystem_of(self.work) == "tmpfs":
            base = Path(sys.prefix).parent
        self.models = Path(tempfile.mkdtemp(prefix="kit-models-", dir=base))
        os.chmod(self.models, 0o755)
        # What gpu-acceptance.sh prepared (--prepared) and whether llama.cpp loaded in its jail.
        self.prepared: dict[str, Any] = {}
        self.llama_jail = ""
        if args.prepared:
            with contextlib.suppress(OSError, ValueError):
                self.prepared = dict(json.loads(Path(args.prepared).read_text()))
            with contextlib.suppress(OSError):
                self.llama_jail = (Path(args.prepared).parent / "llama-jail").read_text().strip()
        self.llama_ok = self.llama_jail.startswith("ok ")
        self._gguf: str | None = None
        self.session_data: dict[str, Any] | None = None

    # -- the server --------------------------------------------------------------------------
    def settings(self, mps: bool = False) -> dict[str, str]:
        env = {
            "SANDBOX_GPU": "1",
            # GPU preload as deployed: warm GPU jails import llama.cpp (where the kit's jail
            # could load it; the preload and session checks say why not otherwise).
            "SANDBOX_PRELOAD": "llama_cpp,appliance.tools" if self.llama_ok else "",
            "SANDBOX_POOL_SIZE": "2",
            "SANDBOX_MAX_CONCURRENCY": "16",
            "SANDBOX_MEMORY_MB": str(self.memory_mb),
            "SANDBOX_MAX_DISK_MB": str(4 * self.memory_mb),
            "SANDBOX_MAX_FILE_MB": str(2 * self.memory_mb),
            "SANDBOX_GPU_MARGIN_MB": str(self.margin),
            "SANDBOX_MAX_EXEC_MS": "120000",
            "SANDBOX_GPU_QUEUE_MS": "120000",
            "SANDBOX_GPU_POLL_MS": "100",
            "SANDBOX_GPU_MPS": "auto" if mps else "off",
            "SANDBOX_FIREJAIL": self.args.firejail,
        }
        env["SANDBOX_MODELS_DIR"] = str(self.models)
        pipe = self.work / ("mps" if mps else "sim-gpu")
        if self.sim:
            # SimulatedGpuMemory stands in for the device's memory (it writes the control file);
            # with --mps the simulated MPS daemon serves the contexts instead.
            control = self.work / "sim.json"
            env |= {
                "SANDBOX_GPU_BACKEND": "simulated",
                "SANDBOX_GPU_SIMULATE": str(self.args.sim_mb),
                "SANDBOX_GPU_SIMULATE_FILE": str(control),
                "SANDBOX_GPU_LIBCUDA": self.args.libcuda,
            }
            if mps:
                pipe.mkdir(exist_ok=True)
                os.chmod(pipe, 0o755)
                env |= {
                    "SANDBOX_GPU_MPS": "auto",
                    "SANDBOX_GPU_SIMULATE_MPS": "on",
                    "SANDBOX_GPU_MPS_PIPE_DIR": str(pipe),
                }
        elif mps:
            env["SANDBOX_GPU_MPS_PIPE_DIR"] = str(pipe)
        for item in self.args.server_env:
            key, _, value = item.partition("=")
            env[key] = value
        return env

    def start(self, mps: bool = False) -> Any:
        from appliance.runtime import local

        return local.start(self.work / ("srv-mps" if mps else "srv"), self.settings(mps), timeout_s=180)

    def readyz(self, server: Any) -> dict[str, Any]:
        status, body = server.get("/readyz")
        data: dict[str, Any] = json.loads(body)
        data["_status"] = status
        return data

    async def execute(self, code: str, budget_mb: int | None, server: Any = None) -> tuple[Any, float]:
        """Run code in a jail with this GPU budget; (Execution, wall time when done arrived)."""
        from appliance_client.client import AsyncClient

        fields: dict[str, Any] = {"gpu": {"memory_mb": budget_mb}} if budget_mb else {}
        async with AsyncClient((server or self.server).url) as c:
            ex = await c.execute(code, **fields)
        return ex, time.time()

    # -- running checks ----------------------------------------------------------------------
    async def check(self, name: str, body: Callable[[], Awaitable[Check]], timeout_s: float) -> Check:
        """Run one check under its time limit; an exception is that check's FAIL."""
        if not self.selected(name):
            result = Check(name, SKIP, "not selected (--only)")
            self.results.append(result)
            return result
        left = self.deadline - time.monotonic()
        started = time.monotonic()
        if left < 5:
            result = Check(name, FAIL, "not run: the kit's time budget (--budget-s) was spent")
        else:
            try:
                result = await asyncio.wait_for(body(), min(timeout_s, left))
            except TimeoutError:
                result = Check(name, FAIL, f"did not finish within {min(timeout_s, left):.0f} s")
            except Exception as exc:  # noqa: BLE001 (any failure of a check is its FAIL, with the reason)
                result = Check(name, FAIL, f"{type(exc).__name__}: {exc}")
        result.name = result.name or name
        result.seconds = round(time.monotonic() - started, 2)
        self.results.append(result)
        print(f"[{result.status}] {result.name}: {result.detail}", flush=True)
        return result

    def selected(self, name: str) -> bool:
        """Whether --only asks for this check (all do without it; the driver query, the server and
        the context's measure always run, as the others need them)."""
        wanted = self.args.only
        return (
            not wanted
            or name in ("preflight.driver", "server", "context")
            or any(name == w or name.startswith(w + ".") for w in wanted)
        )

    async def run(self) -> None:
        if self.args.prepared:
            self.results.append(self.kit_prepared())
        await self.check("preflight.driver", self.preflight_driver, 60)
        await self.check("preflight.mig", self.preflight_mig, 10)
        await self.check("preflight.compute_mode", self.preflight_compute_mode, 10)
        await self.check("preflight.nvidia_uvm", self.preflight_uvm, 30)
        started = await self.check("server", self.start_server, 200)
        names = [
            "context",
            "readyz",
            "preload",
            "session",
            "inference",
            "jail.visible_device",
            "jail.device_nodes",
            "watchdog.main_thread",
            "watchdog.thread",
            "watchdog.subprocess",
            "host_memory",
            "reclaim",
            "contention",
            "contention.overrun_race",
            "llama_offload",
        ]
        if started.status != PASS:
            for name in filter(self.selected, names):
                self.results.append(Check(name, FAIL, "not run: the appliance did not start"))
        else:
            try:
                await self.check("context", self.check_context, 90)
                await self.check("readyz", self.check_readyz, 30)
                await self.check("preload", self.check_preload, 90)
                await self.check("session", self.check_session, 150)
                self.results.append(self.inference_measured())
                await self.check("jail.visible_device", self.check_visible, 90)
                await self.check("jail.device_nodes", self.check_nodes, 90)
                for how in OVERRUN:
                    await self.check(f"watchdog.{how}", lambda how=how: self.check_watchdog(how), 120)  # type: ignore[misc]
                await self.check("host_memory", self.check_host_memory, 150)
                await self.check("reclaim", self.check_reclaim, 150)
                await self.check("contention", self.check_contention, 240)
                await self.check("contention.overrun_race", self.check_overrun_race, 120)
                await self.check("llama_offload", self.check_llama, 120)
            finally:
                self.server.stop()
        if self.gpu_memory is not None:  # a GPU under an MPS daemon takes no plain contexts
            self.gpu_memory.close()
        if self.args.mps:
            await self.check("mps", self.check_mps, 180)
        else:
            self.results.append(Check("mps", SKIP, "optional section not asked for (--mps)"))

    # -- preflight ---------------------------------------------------------------------------
    async def preflight_driver(self) -> Check:
        self.gpus = await asyncio.to_thread(nvidia_smi, self.smi_cmd)
        versions = sorted({g["driver_version"] for g in self.gpus})
        major = min(int(v.split(".")[0]) for v in versions)
        self.total_mb = int(self.gpus[0]["memory.total"])
        data = {"gpus": self.gpus, "driver": versions}
        if major < MIN_DRIVER:
            return Check("", FAIL, f"driver {versions} is older than {MIN_DRIVER}", data=data)
        return Check(
            "",
            PASS,
            f"driver {', '.join(versions)}; {len(self.gpus)} GPU(s): "
            + "; ".join(f"{g['name']} {g['memory.total']} MiB" for g in self.gpus),
            data=data,
        )

    async def preflight_mig(self) -> Check:
        if not self.gpus:
            return Check("", FAIL, "no nvidia-smi answer (see preflight.driver)")
        on = [g["index"] for g in self.gpus if g["mig.mode.current"].lower() == "enabled"]
        if on:
            return Check(
                "",
                FAIL,
                f"MIG is enabled on GPU {', '.join(on)}: the appliance refuses MIG GPUs; "
                "`nvidia-smi -i N -mig 0` and a GPU reset",
            )
        return Check("", PASS, "MIG " + ", ".join(sorted({g["mig.mode.current"] for g in self.gpus})))

    async def preflight_compute_mode(self) -> Check:
        if not self.gpus:
            return Check("", FAIL, "no nvidia-smi answer (see preflight.driver)")
        modes = {g["index"]: g["compute_mode"] for g in self.gpus}
        # The appliance refuses every mode but Default here (no MPS daemon yet: the --mps section
        # sets its own), as appliance.gpu.lease.compute_mode_problem decides.
        other = {i: m for i, m in modes.items() if m.lower() != "default"}
        if other:
            return Check(
                "",
                FAIL,
                f"compute mode {other}: GPU mode refuses to start (jailed runs would get CUDA error 46); "
                + "; ".join(f"nvidia-smi -i {i} -c DEFAULT" for i in other),
                data=modes,
            )
        return Check(
            "", PASS, "compute mode " + ", ".join(f"GPU {i}: {m}" for i, m in modes.items()), data=modes
        )

    async def preflight_uvm(self) -> Check:
        if self.sim:
            return Check("", SKIP, "hardware-only: a simulated host has no /dev/nvidia-uvm")
        if not await asyncio.to_thread(os.path.exists, "/dev/nvidia-uvm"):
            # Jails cannot run the setuid helper that creates it on first use: create it now.
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                await run_cmd(["nvidia-modprobe", "-u", "-c=0"])
        try:
            mode = (await asyncio.to_thread(os.stat, "/dev/nvidia-uvm")).st_mode
        except OSError as exc:
            return Check(
                "", FAIL, f"/dev/nvidia-uvm missing ({exc}); load nvidia-uvm (nvidia-modprobe -u -c=0)"
            )
        if not stat.S_ISCHR(mode):
            return Check("", FAIL, "/dev/nvidia-uvm is not a character device")
        return Check("", PASS, "/dev/nvidia-uvm present")

    async def start_server(self) -> Check:
        if self.sim:
            self.gpu_memory = SimulatedGpuMemory(
                Path(self.args.libcuda),
                self.work / "sim.json",
                self.args.sim_mb,
                free_delay_s=self.args.sim_free_delay_s,
                context_mb=self.args.sim_context_mb,
                context_jitter_mb=self.args.sim_context_jitter_mb,
                free_jitter=self.args.sim_free_jitter,
                usage_unavailable=self.args.sim_usage_unavailable,
                pid_offset=self.args.sim_pid_offset,
            )
        self.server = await asyncio.to_thread(self.start)
        return Check("", PASS, f"appliance ready on {self.server.http}")

    # -- a run's CUDA context -----------------------------------------------------------------
    def fit(self, budget_mb: int) -> int:
        """What a run on budget_mb may allocate and stay within it: NVML counts the run's CUDA
        context in its usage too, so the budget less the context and the slack."""
        mb = budget_mb - self.context_mb - self.slack_mb
        if mb < 1:
            raise RuntimeError(
                f"a {budget_mb} MiB budget leaves nothing to allocate after the CUDA context "
                f"({self.context_mb} MiB) and the slack ({self.slack_mb} MiB)"
            )
        return mb

    def budget_for(self, alloc_mb: int) -> int:
        """The budget a run allocating alloc_mb needs to stay within it (the inverse of fit)."""
        return alloc_mb + self.context_mb + self.slack_mb

    def backend(self) -> Any:
        """The GPU backend the appliance reads (NVML, or the simulated one on its control file)."""
        if self.sim:
            from appliance.gpu.simulated import SimulatedBackend

            return SimulatedBackend((self.args.sim_mb,), self.work / "sim.json")
        from appliance.gpu.nvml import NvmlBackend

        return NvmlBackend()

    async def check_context(self) -> Check:  # noqa: C901, PLR0912, PLR0915 (a check's steps and findings in the order the report lists them)
        """What NVML shows for a jailed run holding a CUDA context and 64 MiB: the context's cost.

        Sampled from the host while the run holds them: the run's new process IDs, as the
        watchdog reads them; that reading is the measure. The device's used memory (what
        admission reads) is recorded beside it, never in its place: where NVML lists the run's
        processes without their memory, or not at all, the watchdog cannot measure the run,
        and the check FAILs, whatever the device's total says."""
        probe_mb, budget = 64, 4096
        backend = await asyncio.to_thread(self.backend)
        try:
            before_ids = {p.pid for p in await asyncio.to_thread(backend.processes)}
            before_used = {d.uuid: d.used_mb for d in await asyncio.to_thread(backend.devices)}
            code = CUDA + f"ctx(); alloc({probe_mb}); time.sleep(3); print('context held', flush=True)"
            run = asyncio.create_task(self.execute(code, budget))
            per_process: dict[str, int] = {}
            device: dict[str, int] = {}
            unknown: set[int] = set()  # the run's processes NVML lists without their memory
            unmatched: dict[int, int] = {}  # new IDs holding memory that are not the server's
            while not run.done():
                procs = await asyncio.to_thread(backend.processes)
                devs = await asyncio.to_thread(backend.devices)
                # As the watchdog matches them: the IDs of every process and thread under the server.
                ours = await asyncio.to_thread(server_ids, self.server.proc.pid)
                new: dict[str, int] = {}
                for proc in procs:
                    if proc.pid in before_ids:
                        continue
                    if proc.pid not in ours:
                        unmatched[proc.pid] = max(unmatched.get(proc.pid, 0), proc.used_mb or 0)
                    elif proc.used_mb is None:
                        unknown.add(proc.pid)
                    else:
                        new[proc.uuid] = new.get(proc.uuid, 0) + proc.used_mb
                for uuid, mb in new.items():
                    per_process[uuid] = max(per_process.get(uuid, 0), mb)
                for dev in devs:
                    delta = dev.used_mb - before_used.get(dev.uuid, dev.used_mb)
                    device[dev.uuid] = max(device.get(dev.uuid, 0), delta)
                await asyncio.sleep(0.1)
            ex, _ = await run
        finally:
            await asyncio.to_thread(backend.close)
        grant = ((ex.frames[0] if ex.frames else {}).get("gpu") or {}).get("uuid")
        seen = per_process.get(grant, 0) if grant else 0
        measured = seen - probe_mb
        data: dict[str, Any] = {
            "grant": grant,
            "per_process_mb": per_process.get(grant) if grant else None,
            "device_delta_mb": device.get(grant) if grant else None,
            "unavailable_pids": sorted(unknown),
            "unmatched_pids": sorted(unmatched),
            "allocated_mb": probe_mb,
            "slack_mb": self.slack_mb,
        }
        verdict = PASS
        if ex.status != "ok" or "context held" not in ex.stdout:
            verdict, detail = (
                FAIL,
                f"a run holding a CUDA context and {probe_mb} MiB ended {ex.status}: {why(ex)}",
            )
        elif unknown or measured <= 0:
            verdict = FAIL
            listed = (
                f"lists the run's processes {sorted(unknown)} without their memory (usedGpuMemory unavailable)"
                if unknown
                else f"names IDs {sorted(unmatched)} that are no process of the server's, holding "
                f"{sum(unmatched.values())} MiB (PIDs of another PID namespace?), and {seen} MiB for the run's"
                if unmatched
                else f"shows {seen} MiB for the run's processes"
            )
            detail = (
                f"NVML {listed} while the run held a CUDA context and {probe_mb} MiB (the device's used "
                f"memory grew {data['device_delta_mb']} MiB): the watchdog reads the per-process figure, "
                "so it cannot measure a run here"
            )
        else:
            self.context_mb = measured
            detail = (
                f"a CUDA context costs {measured} MiB as NVML counts it (per process "
                f"{data['per_process_mb']} MiB, device {data['device_delta_mb']} MiB, less {probe_mb} "
                f"allocated); runs meant to stay within a budget allocate budget - {measured} - "
                f"{self.slack_mb} MiB"
            )
        if verdict == FAIL:
            detail += f"; sizing assumes {self.context_mb} MiB"
        if self.args.context_mb is not None:  # an operator's figure wins (tests: the old kit's 0)
            self.context_mb = self.args.context_mb
            detail += f"; --context-mb: sizing assumes {self.context_mb} MiB"
        data["context_mb"] = self.context_mb
        data["measured_mb"] = measured if verdict == PASS else None
        return Check("", verdict, detail, data=data)

    # -- the appliance -----------------------------------------------------------------------
    async def check_readyz(self) -> Check:
        """/readyz against sources the appliance does not read: nvidia-smi's devices and totals
        (a separate process; in simulation the stand-in's own settings, STUB_SMI_TOTALS, apart
        from the server's), and the UUIDs in the driver's /proc information files, which NVML
        does not produce (where the host has them)."""
        body = await asyncio.to_thread(self.readyz, self.server)
        gpu = body.get("gpu") or {}
        want_backend = "simulated" if self.sim else "nvml"
        ours = sorted((d["uuid"], int(d["total_mb"])) for d in gpu.get("devices", []))
        theirs = sorted((g["uuid"], int(g["memory.total"])) for g in self.gpus)
        driver = sorted(await asyncio.to_thread(device_minors, Path(self.args.driver_info)))
        data = {
            "backend": gpu.get("backend"),
            "readyz": ours,
            "nvidia_smi": theirs,
            "driver_info": driver,
            "status": body["_status"],
            "degraded": gpu.get("degraded"),
        }
        if body["_status"] != 200:
            return Check("", FAIL, f"/readyz answered {body['_status']}", data=data)
        if gpu.get("backend") != want_backend:
            return Check("", FAIL, f"backend {gpu.get('backend')!r}, not {want_backend!r}", data=data)
        if [u for u, _ in ours] != [u for u, _ in theirs] or any(
            abs(a - b) > 1 for (_, a), (_, b) in zip(ours, theirs, strict=True)
        ):
            return Check("", FAIL, f"/readyz devices {ours} differ from nvidia-smi's {theirs}", data=data)
        if driver and [u for u, _ in ours] != driver:
            return Check(
                "",
                FAIL,
                f"/readyz devices {[u for u, _ in ours]} differ from the driver's {self.args.driver_info} "
                f"({driver})",
                data=data,
            )
        if gpu.get("degraded"):
            return Check("", FAIL, f"/readyz reports GPU mode degraded: {gpu['degraded']}", data=data)
        source = f" and {self.args.driver_info}" if driver else f" (no {self.args.driver_info} here)"
        return Check(
            "",
            PASS,
            f"backend {want_backend}; "
            + ", ".join(f"{u} {t} MiB" for u, t in ours)
            + f"; as nvidia-smi{source}",
            data=data,
        )

    async def check_visible(self) -> Check:
        ex, _ = await self.execute(VISIBLE, 256)
        start = ex.frames[0] if ex.frames else {}
        grant = (start.get("gpu") or {}).get("uuid")
        if ex.status != "ok":
            return Check("", FAIL, f"run ended {ex.status}: {why(ex)}")
        seen = json.loads(ex.stdout.strip().splitlines()[-1])
        data = {"grant": grant, **seen}
        if seen["count"] != 1:
            return Check("", FAIL, f"{seen['count']} CUDA devices visible in the jail, not 1", data=data)
        if seen["uuids"][0] != uuid_bytes(str(grant)) or seen["env"] != grant:
            return Check(
                "", FAIL, f"the jail's device {seen['uuids'][0]} is not the grant's {grant}", data=data
            )
        return Check("", PASS, f"one CUDA device, the grant's {grant}", data=data)

    async def check_nodes(self) -> Check:
        host = {
            n
            for n in os.listdir("/dev")
            if re.match(r"^nvidia", n) and stat.S_ISCHR(os.lstat(f"/dev/{n}").st_mode)
        }
        if not host:
            return Check("", SKIP, "hardware-only: this host has no /dev/nvidia* nodes (simulated devices)")
        ex, _ = await self.execute(NODES, 256)
        if ex.status != "ok":
            return Check("", FAIL, f"run ended {ex.status}: {why(ex)}")
        grant = ex.frames[0]["gpu"]
        # The device's node is /dev/nvidia<minor>, and the minor is the driver's, not
        # nvidia-smi's index (which follows PCI order): the driver says which in /proc.
        minors = await asyncio.to_thread(device_minors, Path(self.args.driver_info))
        minor = minors.get(grant["uuid"])
        if minor is None:
            return Check(
                "",
                FAIL,
                f"cannot tell the device minor of {grant['uuid']}: {self.args.driver_info}/*/information "
                f"lists {minors or 'nothing'}",
            )
        want = {"nvidiactl", "nvidia-uvm", f"nvidia{minor}"} & host
        seen = json.loads(ex.stdout.strip().splitlines()[-1])
        chars = {n for n, kind in seen.items() if kind == "char"}
        data = {"host": sorted(host), "jail": seen, "expected": sorted(want), "minor": minor}
        if chars != want:
            return Check(
                "", FAIL, f"jail has device nodes {sorted(chars)}, expected exactly {sorted(want)}", data=data
            )
        return Check(
            "", PASS, f"exactly {sorted(want)} (others: {sorted(set(seen) - chars) or 'none'})", data=data
        )

    async def check_watchdog(self, how: str) -> Check:
        budget = 1024 if self.sim else 2048
        over = budget + self.margin + 512
        code = (
            OVERRUN[how]
            .replace("MB", str(over))
            .replace("HOLD_S", str(self.args.overrun_hold_s))
            .replace("CUDA_SRC", repr(CUDA))
        )
        hog = asyncio.create_task(self.execute(CUDA + code, budget))
        await asyncio.sleep(0.5)
        # The neighbour stays within its budget, its CUDA context included.
        neighbour = asyncio.create_task(
            self.execute(
                CUDA + NEIGHBOUR.replace("MB", "256").replace("SECS", str(self.args.neighbour_s)),
                self.budget_for(256),
            )
        )
        (hog_ex, hog_done), (nb_ex, _) = await asyncio.gather(hog, neighbour)
        stamp = re.search(r"ALLOCATING ([0-9.]+)", hog_ex.stdout)
        latency = round(hog_done - float(stamp.group(1)), 3) if stamp else None
        data = {
            "budget_mb": budget,
            "allocated_mb": over,
            "status": hog_ex.status,
            "message": hog_ex.message,
            "kill_latency_s": latency,
            "neighbour": nb_ex.status,
        }
        if stamp is None:
            return Check(
                "",
                FAIL,
                f"the over-budget run never reached its allocation (ended {hog_ex.status}: {why(hog_ex)})",
                data=data,
            )
        if hog_ex.status != "gpu_memory_limit":
            return Check(
                "",
                FAIL,
                f"an allocation of {over} MiB on a {budget} MiB budget ended "
                f"{hog_ex.status!r}, not gpu_memory_limit",
                data=data,
            )
        if nb_ex.status != "ok" or "neighbour ok" not in nb_ex.stdout:
            return Check("", FAIL, f"the neighbour ended {nb_ex.status}: {why(nb_ex)}", data=data)
        return Check(
            "", PASS, f"stopped {latency} s after allocating {over} MiB on {budget}; neighbour ok", data=data
        )

    async def check_host_memory(self) -> Check:
        # The file is written here, outside the run, so its page cache is charged to the kit
        # and not to the run's memory cgroup: mapped and touched in the jail, those pages are
        # the run's resident file-backed memory (RssFile) and no cgroup reclaim takes them
        # back. That is what issue 14's defect 1 killed (resident memory counted against
        # SANDBOX_MEMORY_MB); a file the run writes itself is reclaimed within its cgroup and
        # proves nothing.
        file_mb = self.memory_mb + 256
        path = self.models / HOST_MEMORY_FILE
        await asyncio.to_thread(write_mapped_file, path, file_mb)
        try:
            code = CUDA + HOST_MEMORY.replace("GPU_MB", "256").replace(
                "NAME", repr(HOST_MEMORY_FILE)
            ).replace("HOLD_S", "3")
            ex, _ = await self.execute(code, self.budget_for(256))
        finally:
            path.unlink(missing_ok=True)
        # And a run that owns more than the cap must not finish: were the reading always 0 (no
        # smaps_rollup, no cgroup) the mapped file above would pass just the same.
        own_mb = self.memory_mb + 128
        owned, _ = await self.execute(
            CUDA
            + HOST_MEMORY_OWNED.replace("GPU_MB", "256")
            .replace("OWN_MB", str(own_mb))
            .replace("HOLD_S", "5"),
            self.budget_for(256),
        )
        data: dict[str, Any] = {
            "memory_mb": self.memory_mb,
            "file_mb": file_mb,
            "filesystem": filesystem_of(self.models),
            "status": ex.status,
            "owned_mb": own_mb,
            "owned_status": owned.status,
        }
        if owned.status != "memory_limit" or "still running" in owned.stdout:
            return Check(
                "",
                FAIL,
                f"a GPU run owning {own_mb} MiB of written memory under SANDBOX_MEMORY_MB={self.memory_mb} "
                f"ended {owned.status} ({why(owned) or 'not stopped'}), not memory_limit: the host-memory cap "
                "did not hold",
                data=data,
            )
        if ex.status != "ok":
            return Check(
                "",
                FAIL,
                f"a GPU run mapping {file_mb} MiB of a file under SANDBOX_MEMORY_MB="
                f"{self.memory_mb} ended {ex.status}: {why(ex)}",
                data=data,
            )
        seen = json.loads(ex.stdout.strip().splitlines()[-1])
        data |= seen
        if seen.get("touched", 0) != file_mb << 8:  # one byte of value 1 per 4 KiB page
            return Check("", FAIL, f"the run did not read its whole mapping ({seen})", data=data)
        if seen.get("RssFile", 0) <= self.memory_mb:
            return Check(
                "",
                FAIL,
                f"inconclusive: the run's file-backed resident memory stayed at {seen.get('RssFile')} MiB, "
                f"not above SANDBOX_MEMORY_MB={self.memory_mb}, so the cap was never put to the test",
                data=data,
            )
        return Check(
            "",
            PASS,
            f"ok with {seen.get('RssFile')} MiB of a mapped file resident (RssFile; RssAnon "
            f"{seen.get('RssAnon')} MiB) for 3 s of 100 ms polls, over SANDBOX_MEMORY_MB={self.memory_mb}; "
            f"a run owning {own_mb} MiB ended memory_limit",
            data=data,
        )

    async def check_reclaim(self) -> Check:
        total = self.total_mb
        first, big = int(total * 0.3), int(total * 0.72)
        over = first + self.margin + 512
        # The first run holds memory within its budget for 2 s, so the big run (sent after 1 s)
        # queues behind it, and only then goes over: it is killed after the big run queued,
        # and the big run is admitted when its grant goes back, by a reading taken before the
        # kill. Only the reclaim hold then keeps the big run off the memory the killed run
        # still holds (a kill is not a free).
        held = self.fit(first)
        first_code = f"ctx(); alloc({held}); time.sleep(2); alloc_over({over - held}); time.sleep(20)"
        # The big run stays within its budget, its CUDA context included: only memory the
        # killed run still held could make its allocation fail. It holds the allocation for
        # some watchdog polls, as a real run would: one over its budget is stopped.
        big_alloc = self.fit(big)
        killed = asyncio.create_task(self.execute(CUDA + first_code, first))
        await asyncio.sleep(1.0)
        queued = asyncio.create_task(
            self.execute(CUDA + f"ctx(); alloc({big_alloc}); time.sleep(2); print('big ok')", big)
        )
        (k_ex, _), (q_ex, _) = await asyncio.gather(killed, queued)
        queued_ms = q_ex.frames[0].get("queued_ms") if q_ex.frames else None
        data = {
            "first_budget_mb": first,
            "first_allocated_mb": over,
            "first": k_ex.status,
            "big_budget_mb": big,
            "big_allocated_mb": big_alloc,
            "context_mb": self.context_mb,
            "big": q_ex.status,
            "big_queued_ms": queued_ms,
            "big_error": q_ex.error.value if q_ex.error else None,
        }
        if k_ex.status != "gpu_memory_limit":
            return Check("", FAIL, f"the first run ended {k_ex.status}, not gpu_memory_limit", data=data)
        if q_ex.error is not None and q_ex.error.name == "MemoryError":
            return Check(
                "", FAIL, f"the queued {big} MiB run hit CUDA out-of-memory: {q_ex.error.value}", data=data
            )
        if q_ex.status != "ok":
            return Check("", FAIL, f"the queued run ended {q_ex.status}: {why(q_ex)}", data=data)
        if not queued_ms:
            return Check(
                "", FAIL, "the big run did not queue behind the killed one: nothing was tested", data=data
            )
        return Check(
            "",
            PASS,
            f"{big} MiB run (allocating {big_alloc} MiB and its context) queued {queued_ms} ms behind a "
            f"killed {over} MiB one, then ok",
            data=data,
        )

    async def check_contention(self) -> Check:
        """N = 1, 4, 16 of the contention mix without its overrunner: every run stays within its
        grant (its CUDA context included), and that the appliance does promise: admission keeps
        each running run's grant and margin backed by memory the device has, so none of these
        runs may end out of memory, or stopped, at any N."""
        from benchmarks import gpu_contention as gc

        scale = self.total_mb / gc.DEVICE_MB
        within = [m for m in gc.MIX if m[0] not in gc.OVERRUNNERS]
        samples: list[dict[str, Any]] = []
        sampler = gc.readyz_sampler(self.server.http) if self.sim else gc.nvml_sampler
        records: list[Any] = []
        for n in (1, 4, 16):
            records += await gc.server_level(
                self.server.url,
                n,
                samples,
                scale,
                sampler=sampler,
                mix=within,
                context_mb=self.context_mb,
                slack_mb=self.slack_mb,
            )
        rows = gc.summarise(records)
        expected = {"oversized": "rejected"}  # past the largest device: refused at once
        bad = [r for r in records if r.outcome != expected.get(r.kind, "ok")]
        data = {"summary": rows, "scale": round(scale, 3), "context_mb": self.context_mb}
        text = "; ".join(f"N={r['n']}: {gc.outcomes_text(r)}, queue p95 {r['queue_p95_ms']} ms" for r in rows)
        if bad:
            kinds = sorted({f"{r.kind} {r.outcome} (N={r.n})" for r in bad})
            return Check(
                "",
                FAIL,
                f"{len(bad)} run(s) within their grants did not end as expected: {kinds}; {text}",
                data=data,
            )
        if not any(r.queued_ms > 0 for r in records if r.n == 16):
            return Check(
                "", FAIL, f"inconclusive: nothing queued at N=16, so nothing contended: {text}", data=data
            )
        return Check("", PASS, f"no run within its grant failed: {text}", data=data)

    async def check_overrun_race(self) -> Check:
        """The mix with its overrunners at N = 16. An overrunner that takes budget + margin +
        512 MiB at once can take memory a neighbour was granted until the next watchdog poll
        stops it; polling cannot prevent that (docs/gpu.md), so how many neighbours ran out of
        memory is INFO, a measurement. That every overrunner was stopped (gpu_memory_limit) is
        promised: FAIL otherwise (a watchdog that cannot see or never kills)."""
        from benchmarks import gpu_contention as gc

        scale = self.total_mb / gc.DEVICE_MB
        sampler = gc.readyz_sampler(self.server.http) if self.sim else gc.nvml_sampler
        records = await gc.server_level(
            self.server.url,
            16,
            [],
            scale,
            sampler=sampler,
            context_mb=self.context_mb,
            slack_mb=self.slack_mb,
        )
        over = [r for r in records if r.kind in gc.OVERRUNNERS]
        neighbours = [
            r for r in records if r.kind not in gc.OVERRUNNERS and r.budget_mb and r.outcome != "rejected"
        ]
        ooms = [r for r in neighbours if r.outcome == "oom"]
        row = gc.summarise(records)[0]
        data = {
            "summary": [row],
            "overrunners": [r.outcome for r in over],
            "neighbours": len(neighbours),
            "neighbours_oom": len(ooms),
        }
        loose = sorted(r.outcome for r in over if r.outcome != "gpu_memory_limit")
        if loose or not over:
            return Check(
                "",
                FAIL,
                f"{len(loose)} of {len(over)} overrunner(s) taking budget + margin + 512 MiB were not stopped "
                f"by the watchdog (ended {loose}): an overrun is stopped at the next poll, or budgets hold "
                f"nothing; {gc.outcomes_text(row)}",
                data=data,
            )
        return Check(
            "",
            INFO,
            f"informational, no verdict on the neighbours (polling promises nothing there): N=16 with {len(over)} overrunner(s) "
            f"taking budget + margin + 512 MiB at once (ended {sorted(r.outcome for r in over)}); "
            f"{len(ooms)} of {len(neighbours)} neighbours within their grants hit CUDA out-of-memory "
            f"before a poll stopped the overrunner; {gc.outcomes_text(row)}",
            data=data,
        )

    # -- what the kit prepared, GPU preload, a GPU session, inference -----------------------
    def kit_prepared(self) -> Check:
        """gpu-acceptance.sh's preparation: the sandbox user, the setuid firejail and the
        libraries it lacked, the Python, the libraries found by absolute path, llama.cpp's jail."""
        p = self.prepared
        libs = p.get("libraries") or {}
        found = ", ".join(f"{k} {v or 'NOT FOUND'}" for k, v in libs.items())
        detail = (
            f"Python {p.get('python_version')} ({p.get('python')}) -> {p.get('venv')}; firejail {p.get('firejail')}"
            f" (kit libraries: {', '.join(p.get('kit_libs') or []) or 'none needed'}); {found}; "
            f"llama.cpp ({p.get('llama') or 'none'}, {p.get('llama_from')}): "
            f"{self.llama_jail or p.get('llama_problem') or 'not probed'}"
        )
        return Check("kit.prepare", PASS, detail, data={**p, "llama_jail": self.llama_jail})

    def llama_missing(self) -> str:
        """Why llama.cpp is not in the jails, where it is not."""
        return (
            self.llama_jail
            or str(self.prepared.get("llama_problem") or "")
            or "no llama-cpp-python installed"
        )

    async def gguf_name(self) -> str | None:
        """--gguf's model, copied into the models directory (kept for the session and inference)."""
        if not self.args.gguf:
            return None
        if self._gguf is None:
            self._gguf = (await asyncio.to_thread(place_model, Path(self.args.gguf), self.models)).name
        return self._gguf

    async def check_preload(self) -> Check:
        # A GPU run in a warm jail: llama.cpp must already be imported there (SANDBOX_PRELOAD),
        # and on a GPU it must see the granted device.
        if not self.llama_ok:
            return Check("", FAIL, f"GPU preload not possible: {self.llama_missing()}")
        code = (
            "import sys, json\n"
            "pre = 'llama_cpp' in sys.modules\n"
            "import llama_cpp\n"
            "print(json.dumps({'preloaded': pre, 'offload': bool(llama_cpp.llama_supports_gpu_offload()),"
            " 'system': llama_cpp.llama_print_system_info().decode(errors='replace')[:300]}))"
        )
        ex, _ = await self.execute(code, self.budget_for(64))
        if ex.status != "ok":
            return Check("", FAIL, f"the GPU run ended {ex.status}: {why(ex)}")
        data = json.loads(ex.stdout.strip().splitlines()[-1])
        if not data["preloaded"]:
            return Check(
                "", FAIL, "a GPU run's warm jail had not imported llama_cpp (SANDBOX_PRELOAD)", data=data
            )
        if self.sim:
            return Check(
                "",
                PASS,
                "llama_cpp preloaded in the warm GPU jail (offload: hardware-only, the stand-in libcuda has no "
                f"CUDA runtime behind it; llama_supports_gpu_offload() {data['offload']})",
                data=data,
            )
        if not data["offload"]:
            return Check("", FAIL, "llama_cpp preloaded, but it sees no GPU in the jail", data=data)
        return Check(
            "", PASS, "llama_cpp preloaded in the warm GPU jail and offloads to its device", data=data
        )

    async def check_session(self) -> Check:
        # A GPU session: the model loaded in the first cell, used again in the next ones without
        # loading it anew (the same object, in the same interpreter, on the same grant).
        if not self.llama_ok:
            return Check("", FAIL, f"no GPU session with llama.cpp: {self.llama_missing()}")
        name = await self.gguf_name()
        if name is None:
            return Check("", SKIP, "no model: add --gguf PATH (the kit passes its own)")
        from appliance_client.client import AsyncClient

        budget = self.budget_for(1024)
        load = (
            "import time\n"
            "from appliance.tools import load_llm\n"
            "t0 = time.perf_counter()\n"
            # Every layer on the GPU; the simulated GPU has no CUDA runtime, so there the CPU.
            f"llm = load_llm({name!r}, n_gpu_layers={0 if self.sim else -1})\n"
            "t1 = time.perf_counter()\n"
            "out = llm.model('Hello', max_tokens=16, logit_bias={2: -100.0})\n"
            "t2 = time.perf_counter()\n"
            "print('SESSION', id(llm), llm.shape.n_gpu_layers, round(t1 - t0, 4), round(t2 - t1, 4),"
            " out['usage']['completion_tokens'])"
        )
        again = (
            "t1 = time.perf_counter()\n"
            "out = llm.model('Hello again', max_tokens=16, logit_bias={2: -100.0})\n"
            "t2 = time.perf_counter()\n"
            "print('SESSION', id(llm), llm.shape.n_gpu_layers, 0, round(t2 - t1, 4), out['usage']['completion_tokens'])"
        )
        cells: list[Any] = []
        async with AsyncClient(self.server.url) as c:
            session = c.session()
            try:
                for code in (load, again, again):
                    cells.append(await session.execute(code, gpu={"memory_mb": budget}))
                    if cells[-1].status != "ok":
                        break
                ids = {ex.session for ex in cells}
            finally:
                await session.close()
        bad = next((ex for ex in cells if ex.status != "ok"), None)
        if bad is not None:
            return Check(
                "", FAIL, f"cell {cells.index(bad) + 1} of the GPU session ended {bad.status}: {why(bad)}"
            )
        rows = [
            re.search(r"^SESSION (\d+) (-?\d+) ([\d.]+) ([\d.]+) (\d+)$", ex.stdout, re.M) for ex in cells
        ]
        if not all(rows):
            return Check(
                "", FAIL, "a cell printed no SESSION line: " + " / ".join(ex.stdout[-200:] for ex in cells)
            )
        parsed = [m.groups() for m in rows if m]
        llm_ids = [r[0] for r in parsed]
        layers = int(parsed[0][1])
        data: dict[str, Any] = {
            "budget_mb": budget,
            "sessions": sorted(str(i) for i in ids),
            "llm_ids": llm_ids,
            "n_gpu_layers": [int(r[1]) for r in parsed],
            "load_s": float(parsed[0][2]),
            "generate_s": [float(r[3]) for r in parsed],
            "tokens": [int(r[4]) for r in parsed],
        }
        self.session_data = data
        if len(ids) != 1 or len(set(llm_ids)) != 1:
            return Check("", FAIL, f"the cells did not share one session and one model: {data}", data=data)
        if not self.sim and layers <= 0:
            return Check("", FAIL, f"the session's model has {layers} layers on the GPU", data=data)
        return Check(
            "",
            PASS,
            f"one GPU session ({budget} MiB): the model loaded once ({data['load_s']} s, {layers} layers offloaded"
            f"{' as asked; the simulated GPU runs them on the CPU' if self.sim else ''}) and answered in 3 cells",
            data=data,
        )

    def inference_measured(self) -> Check:
        """INFO: the session's generation speed, and what loading once saves (no verdict)."""
        data = self.session_data
        if not self.selected("inference"):
            return Check("inference", SKIP, "not selected (--only)")
        if not data:
            return Check("inference", SKIP, "no GPU session ran (see session)")
        gen = data["generate_s"]
        rate = [round(t / s, 1) if s else None for t, s in zip(data["tokens"], gen, strict=True)]
        later = sum(gen[1:]) / max(1, len(gen) - 1)
        ratio = round((data["load_s"] + gen[0]) / later, 1) if later else None
        return Check(
            "inference",
            INFO,
            f"informational, no verdict: {rate} tokens/s per cell ({'CPU, simulated GPU' if self.sim else 'GPU'}); "
            f"the first cell (load + generate) took {ratio}x a later one's generation",
            data={**data, "tokens_per_s": rate, "first_vs_later": ratio},
        )

    async def check_llama(self) -> Check:  # noqa: C901, PLR0912 (a check's steps and findings in the order the report lists them)
        # The startup probe's answer (the bindings imported in the jails' Python), once it is in.
        deadline = time.monotonic() + 60
        while True:
            body = await asyncio.to_thread(self.readyz, self.server)
            tools = body.get("tools") or {}
            if not tools.get("probing") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        llama = tools.get("llama_cpp") or {}
        wheels = self.args.wheels
        supply = (
            "supply a CUDA build for this Python with gpu-acceptance.sh --wheels DIR (or KIT_WHEELS=DIR): "
            'DIR holds a llama_cpp_python-*.whl built with CMAKE_ARGS="-DGGML_CUDA=on" against the '
            "machine's CUDA, and the wheels of its requirements (numpy, diskcache, jinja2, typing-extensions)"
        )
        if wheels is None:
            source = f"the kit's own build, {self.prepared.get('llama') or 'none carried'}"
        elif not await asyncio.to_thread(lambda: sorted(Path(wheels).glob("llama_cpp_python-*.whl"))):
            source = f"--wheels {wheels} holds no llama_cpp_python-*.whl"
        else:
            source = f"installed from --wheels {wheels}"
        if tools.get("probing"):
            return Check("", SKIP, "the appliance's tools probe had not answered after 60 s", data=tools)
        if not llama.get("available"):
            return Check(
                "",
                SKIP,
                f"llama-cpp-python does not import in the appliance's Python "
                f"({llama.get('error') or tools.get('error')}; {source}): {supply}",
                data=llama,
            )
        if self.sim:
            return Check(
                "",
                SKIP,
                f"hardware-only: llama-cpp-python {llama.get('version')} ({source}) imports, but the simulated "
                "GPU has no CUDA runtime behind it to offload to",
                data=llama,
            )
        if not llama.get("gpu_offload"):
            return Check(
                "",
                SKIP,
                f"llama-cpp-python {llama.get('version')} is a CPU build: llama_supports_gpu_offload() "
                f"is false ({source}): {supply}",
                data=llama,
            )
        if not self.args.gguf:
            return Check(
                "",
                SKIP,
                f"llama-cpp-python {llama.get('version')} can offload ({source}), but no model was given: "
                "add --gguf PATH (a GGUF file the kit copies into its models directory)",
                data=llama,
            )
        from appliance.inside.tools import shaping

        model = await asyncio.to_thread(place_model, Path(self.args.gguf), self.models)
        info = await asyncio.to_thread(shaping.read_gguf, str(model))
        ctx = min(info.n_ctx_train, 4096) if info.n_ctx_train else 512
        # Every layer fits with room: shaping's estimate (its own context guess included), plus
        # the measured context and 1 GiB for llama.cpp's compute buffers. What is tested is the
        # offload, not how close shaping's estimate runs to the budget.
        budget = shaping.estimate_mb(info, info.n_layer + 1, ctx) + self.context_mb + 1024
        code = (
            "from appliance.tools import load_llm\n"
            f"llm = load_llm({model.name!r}, n_gpu_layers=-1)\n"
            "print(repr(llm('Hello', max_tokens=4)))\n"
            "print('layers', llm.shape.n_gpu_layers)"
        )
        data = {**llama, "budget_mb": budget, "n_layer": info.n_layer}
        try:
            ex, _ = await self.execute(code, budget)
        finally:
            model.unlink(missing_ok=True)
        if ex.status != "ok":
            return Check(
                "", FAIL, f"load_llm with all layers offloaded ended {ex.status}: {why(ex)}", data=data
            )
        layers = re.search(r"^layers (\d+)$", ex.stdout, re.M)
        data["n_gpu_layers"] = int(layers.group(1)) if layers else None
        if data["n_gpu_layers"] != info.n_layer + 1:
            return Check(
                "",
                FAIL,
                f"load_llm offloaded {data['n_gpu_layers']} of {info.n_layer + 1} layers on a {budget} MiB budget",
                data=data,
            )
        return Check(
            "",
            PASS,
            f"a model loaded with all {info.n_layer + 1} layers offloaded ({budget} MiB) and generated",
            data=data,
        )

    # -- MPS (optional) ----------------------------------------------------------------------
    async def check_mps(self) -> Check:  # noqa: C901, PLR0912 (a check's steps and findings in the order the report lists them)
        before = {g["index"]: g["compute_mode"] for g in await asyncio.to_thread(nvidia_smi, self.smi_cmd)}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "compute-mode.orig").write_text(json.dumps(before))  # the shell's trap restores from it
        daemon = not self.sim
        try:
            for index in before:
                await run_cmd([*self.smi_cmd, "-i", index, "-c", "EXCLUSIVE_PROCESS"], check=True)
            if daemon:
                env = {
                    **os.environ,
                    "CUDA_MPS_PIPE_DIRECTORY": str(self.work / "mps"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.work / "mps-log"),
                }
                (self.work / "mps").mkdir(exist_ok=True)
                (self.work / "mps-log").mkdir(exist_ok=True)
                os.chmod(self.work / "mps", 0o755)
                await run_cmd(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
                (self.out / "mps-started").write_text(env["CUDA_MPS_PIPE_DIRECTORY"])  # for the shell's trap
            if self.sim:  # the simulated NVML learns the mode nvidia-smi set (the stand-in's state)
                modes = {
                    g["index"]: g["compute_mode"].upper()
                    for g in await asyncio.to_thread(nvidia_smi, self.smi_cmd)
                }
                control = self.work / "sim.json"
                control.write_text(json.dumps({"compute_mode": modes}))
            refused = ""
            try:
                server = await asyncio.to_thread(self.start, True)
            except Exception as exc:  # noqa: BLE001 (a refusal to start is this section's answer)
                refused = str(exc)
                server = None
            if server is None:
                ok = "EXCLUSIVE_PROCESS compute mode" in refused and "-c DEFAULT" in refused
                return Check(
                    "mps.host",
                    PASS if ok else FAIL,
                    (
                        "the appliance refused the MPS host at startup, naming the fix: "
                        if ok
                        else "the appliance did not start on the MPS host, for another reason: "
                    )
                    + refused[-600:],
                    data={"refused": refused[-2000:]},
                )
            try:
                mps = (await asyncio.to_thread(self.readyz, server)).get("gpu", {}).get("mps", {})
                budget = 1024
                ex, _ = await self.execute(
                    CUDA + f"ctx(); alloc({budget + self.margin + 512})", budget, server
                )
                nb, _ = await self.execute(
                    CUDA + NEIGHBOUR.replace("MB", "512").replace("SECS", "1"), self.budget_for(512), server
                )
            finally:
                server.stop()
        finally:
            if daemon:
                await run_cmd(["nvidia-cuda-mps-control"], input=b"quit\n", env=env)
                (self.out / "mps-started").unlink(missing_ok=True)
            for index, mode in before.items():
                await run_cmd([*self.smi_cmd, "-i", index, "-c", mode.upper()])
            after = {g["index"]: g["compute_mode"] for g in await asyncio.to_thread(nvidia_smi, self.smi_cmd)}
            if after == before:
                (self.out / "compute-mode.orig").unlink(missing_ok=True)
            self.results.append(
                Check(
                    "mps.restored",
                    PASS if after == before else FAIL,
                    f"compute mode {'restored to' if after == before else 'NOT restored:'} {after}",
                    data={"before": before, "after": after},
                )
            )
        data = {"readyz_mps": mps, "overrun": ex.status, "error": why(ex), "neighbour": nb.status}
        oom = ex.error is not None and ex.error.name == "MemoryError"
        if nb.status != "ok":
            return Check("mps.host", FAIL, f"with MPS the neighbour ended {nb.status}: {why(nb)}", data=data)
        if mps.get("enforcing"):  # the appliance claims daemon-side limits: the allocation must be refused
            if oom:
                return Check(
                    "mps.host",
                    PASS,
                    "MPS limits enforced: the over-budget allocation was refused",
                    data=data,
                )
            return Check(
                "mps.host",
                FAIL,
                f"/readyz claims MPS limits, but the over-budget run ended {ex.status} ({why(ex)})",
                data=data,
            )
        # Not claimed: the claim is true if the watchdog still stops the overrun.
        if ex.status == "gpu_memory_limit":
            return Check(
                "mps.host",
                PASS,
                f"MPS reported not enforcing ({mps.get('note')}); the watchdog stopped the over-budget run",
                data=data,
            )
        return Check(
            "mps.host",
            FAIL,
            f"MPS reported not enforcing and the over-budget run ended "
            f"{ex.status} ({why(ex)}), not gpu_memory_limit",
            data=data,
        )

    # -- the report --------------------------------------------------------------------------
    def write(self, seconds: float) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        counts = {s: sum(1 for r in self.results if r.status == s) for s in (PASS, FAIL, SKIP, INFO)}
        meta: dict[str, Any] = {
            "mode": "simulated" if self.sim else "real-gpu",
            "host": platform.node(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(),
            "kit": _kit_meta(),
            "gpus": self.gpus,
            "seconds": round(seconds, 1),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "counts": counts,
        }
        report = {"meta": meta, "checks": [asdict(r) for r in self.results]}
        (self.out / "gpu-acceptance.json").write_text(json.dumps(report, indent=1))
        gpus = (
            "; ".join(
                f"{g['name']} ({g['uuid']}, {g['memory.total']} MiB, driver {g['driver_version']})"
                for g in self.gpus
            )
            or "unknown"
        )
        lines = [
            f"# GPU acceptance ({meta['mode']})",
            "",
            f"{meta['when']}, {meta['machine']}, Python {meta['python']}, kit {meta['kit'].get('commit', '?')}; "
            f"{seconds:.0f} s. GPUs: {gpus}.",
            "",
            f"PASS {counts[PASS]}, FAIL {counts[FAIL]}, SKIP {counts[SKIP]}; INFO {counts[INFO]} "
            "(measurements where the appliance promises nothing: no verdict).",
            "",
            "| check | result | detail | s |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} | {r.seconds} |" for r in self.results
        ]
        (self.out / "gpu-acceptance.md").write_text("\n".join(lines) + "\n")
        return report


def _kit_meta() -> dict[str, Any]:
    """kit.json of the kit this runs from (absent when run from a checkout)."""
    for candidate in (Path(__file__).resolve().parent.parent / "kit.json",):
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(candidate.read_text()))
    return {}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where gpu-acceptance.json and .md go")
    p.add_argument("--simulate", action="store_true", help="simulated devices (make test), not a GPU")
    p.add_argument("--sim-mb", type=int, default=16384, help="--simulate: the simulated device's MiB")
    p.add_argument("--libcuda", default="libcuda.so.1", help="--simulate: the stand-in libcuda jails load")
    p.add_argument(
        "--nvidia-smi", default="nvidia-smi", help="the nvidia-smi command (a stand-in in simulation)"
    )
    p.add_argument("--firejail", default="firejail", help="the firejail binary (the kit's own)")
    p.add_argument(
        "--mps", action="store_true", help="also the MPS section (sets and restores the compute mode)"
    )
    p.add_argument(
        "--sim-context-mb",
        type=int,
        default=SIM_CONTEXT_MB,
        help="--simulate: what the simulated GPU charges for each CUDA context",
    )
    p.add_argument(
        "--sim-free-delay-s",
        type=float,
        default=1.5,
        help="--simulate: how long the simulated GPU holds a gone process's memory",
    )
    p.add_argument(
        "--sim-context-jitter-mb",
        type=int,
        default=SIM_CONTEXT_JITTER_MB,
        help="--simulate: each context costs up to this much more than --sim-context-mb",
    )
    p.add_argument(
        "--sim-free-jitter",
        type=float,
        default=0.5,
        help="--simulate: each free comes up to this fraction of --sim-free-delay-s later still",
    )
    p.add_argument(
        "--sim-usage-unavailable",
        action="store_true",
        help="--simulate: NVML lists processes without their memory (usedGpuMemory unavailable)",
    )
    p.add_argument(
        "--sim-pid-offset",
        type=int,
        default=0,
        help="--simulate: NVML lists processes under their PID plus this (IDs of another PID namespace)",
    )
    p.add_argument(
        "--driver-info",
        default="/proc/driver/nvidia/gpus",
        help="the driver's per-GPU information files (UUID, minor), read apart from NVML",
    )
    p.add_argument(
        "--context-mb",
        type=int,
        default=None,
        help="size the checks' allocations by this CUDA context cost instead of the measured one",
    )
    p.add_argument("--gguf", help="a GGUF model for the llama.cpp checks (the kit passes its own tiny one)")
    p.add_argument(
        "--prepared",
        default=None,
        help="gpu-acceptance.sh's prepare.json (what it installed and found; llama-jail beside it)",
    )
    p.add_argument(
        "--wheels",
        default=None,
        help="the folder of wheels gpu-acceptance.sh installed llama-cpp-python from (KIT_WHEELS)",
    )
    p.add_argument("--only", action="append", default=[], help="run only this check (or prefix); repeatable")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="SANDBOX_X=V",
        help="a setting for the appliance under test (overrides the kit's)",
    )
    p.add_argument(
        "--neighbour-s", type=float, default=6, help="how long the watchdog checks' neighbour runs"
    )
    p.add_argument(
        "--overrun-hold-s",
        type=float,
        default=20,
        help="how long the watchdog checks' over-budget run holds its memory unless stopped",
    )
    p.add_argument("--budget-s", type=float, default=450, help="stop starting checks after this long")
    p.add_argument(
        "--tmp", default=None, help="where the servers' scratch folders go (default: $TMPDIR or /tmp)"
    )
    return p.parse_args(argv)


async def amain(argv: list[str] | None = None) -> int:
    """Run the checks, write the report; 0 when nothing FAILed."""
    args = parse(argv)
    kit = Kit(args)
    started = time.monotonic()
    try:
        await kit.run()
    finally:
        report = kit.write(time.monotonic() - started)
        if kit.gpu_memory is not None:
            kit.gpu_memory.close()
        # The servers' logs go with the report; the scratch folder (workspaces, pipes) does not stay.
        for log in kit.work.glob("srv*/server.log"):
            shutil.copyfile(log, kit.out / f"{log.parent.name}.log")
        shutil.rmtree(kit.work, ignore_errors=True)
        shutil.rmtree(kit.models, ignore_errors=True)  # outside work where work is on a tmpfs
    counts = report["meta"]["counts"]
    print(
        f"PASS {counts[PASS]}, FAIL {counts[FAIL]}, SKIP {counts[SKIP]}, INFO {counts[INFO]}; "
        f"report: {kit.out}/gpu-acceptance.md"
    )
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(amain()))
