"""The frozen description of one jail: who, what is visible, which limits, which env.

Built once from settings (and, later, a request); rendered to a firejail argv by
`appliance.sandbox.firejail.render_argv`, a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.settings import Settings

WORKSPACE = Path("/workspace")

# Top-level entries of / a jail may see; everything else at the top level is hidden.
VISIBLE_TOP_LEVEL = frozenset(
    {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "proc", "dev", "tmp", "sys"}
)

# The only files of the host's /etc a jail gets (firejail --private-etc copies these, or the
# server prepares them once: appliance.sandbox.etcdir).
ETC_FILES = (
    "alternatives",
    "fonts",
    "group",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "passwd",
    "ssl",
)


@dataclass(frozen=True)
class JailLimits:
    """Per-run limits; units are in the names. `memory_mb=None` means no RLIMIT_AS."""

    memory_mb: int | None
    max_procs: int
    file_mb: int
    open_files: int


@dataclass(frozen=True)
class JailSpec:
    """Everything that decides how one jail is made."""

    workdir: Path  # host directory mounted as /workspace (owned by uid)
    uid: int
    gid: int
    python: Path  # interpreter run inside the jail
    driver: Path  # the in-jail driver script (readable by uid)
    limits: JailLimits
    readable: tuple[Path, ...]  # host paths whitelisted read-only (python env, runtime)
    root_entries: tuple[str, ...]  # names found at the host's / (to hide what is not allowed)
    run_entries: tuple[str, ...]  # names found in the host's /run (firejail needs /run itself)
    env: tuple[tuple[str, str], ...]  # the jail's whole environment (besides firejail's own)
    devices: tuple[Path, ...] = ()  # extra /dev nodes (GPU mode); none in CPU mode
    nice: int = 0  # pool refills start at lower priority than running work
    netns: str | None = None  # egress mode: the prepared namespace the jail starts in
    dns: tuple[str, ...] = ()  # egress mode with 53 open: the jail's only resolvers
    gpu: bool = False  # GPU mode: CUDA-capable jail (no RLIMIT_AS, GPU nodes)
    gpu_hidden: tuple[Path, ...] = ()  # GPU mode: host GPU nodes and /sys/module entries to hide
    gpu_shared: tuple[Path, ...] = ()  # GPU mode with MPS: the daemon's pipe dir, whitelisted read-write
    etc: Path | None = None  # the server's prepared /etc, bound over /etc before firejail (`etcdir`)
    hooks_hidden: tuple[
        Path, ...
    ] = ()  # the server's own editable installs' .pth in `readable` (`jail.own_hooks`)

    @property
    def hidden(self) -> tuple[Path, ...]:
        """Host paths blacklisted in the jail: top-level entries (and /run entries) that are
        neither allowed nor holding a path the jail is given."""
        given = self.readable + self.gpu_shared
        holders = {p.parts[1] for p in given if len(p.parts) > 1}
        keep = VISIBLE_TOP_LEVEL | holders | {WORKSPACE.name, "run"}
        hidden = [Path("/") / name for name in sorted(self.root_entries) if name not in keep]
        if "run" in self.root_entries:
            # /run cannot be blacklisted whole (firejail keeps its state in /run/firejail):
            # each entry is, but firejail's own and those holding a given path (an MPS pipe dir).
            run_keep = {"firejail"} | {p.parts[2] for p in given if len(p.parts) > 2 and p.parts[1] == "run"}
            hidden += [Path("/run") / name for name in sorted(self.run_entries) if name not in run_keep]
        return tuple(hidden)


def jail_env(
    settings: Settings, python: Path, runtime: Path, preload: tuple[str, ...]
) -> tuple[tuple[str, str], ...]:
    """The complete environment of jailed code: nothing of the server's own env is copied.
    `preload`: the modules the driver imports before its first run (the jail's profile)."""
    threads = str(settings.jail_threads)
    env = {
        "HOME": str(WORKSPACE),
        "PATH": f"{python.parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "module://appliance.inside.appliance_mpl",
        "MPLCONFIGDIR": "/tmp/matplotlib",
        "APPLIANCE_RUNTIME": str(runtime),
        "OPENBLAS_NUM_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "NUMEXPR_MAX_THREADS": threads,
        "TMPDIR": "/tmp",
        "APPLIANCE_PRELOAD": ",".join(preload),
    }
    if settings.models_dir is not None:  # read by appliance.tools: models load only from here
        env["SANDBOX_MODELS_DIR"] = str(settings.models_dir)
    if settings.wheelhouse is not None:  # read by appliance.inside.magics: pip installs only from here
        env["APPLIANCE_WHEELHOUSE"] = str(settings.wheelhouse)
    return tuple(sorted(env.items()))
