"""Which GPU device nodes and /sys entries a GPU run sees, and which it must not. Pure.

Facts about firejail 0.9.72 this relies on (checked against a real firejail with
stand-in nodes, see docs/gpu.md): `--private-dev` brings `/dev/nvidia[0-9]*`,
`/dev/nvidiactl`, `/dev/nvidia-modeset`, `/dev/nvidia-uvm`, `/dev/dri` (and `/dev/kfd`
in later versions) into the jail's new /dev unless `--no3d` is given; it never brings
`/dev/nvidia-uvm-tools` or `/dev/nvidia-caps`. `--blacklist` of a node replaces it with an
empty root-only file. Firejail blacklists `/sys/module` whole; `--noblacklist=/sys/module`
undoes that, after which every entry not named nvidia* is blacklisted again with a few
glob patterns (firejail 0.9.72 takes at most 128 arguments, so not one per module, and
rejects `[!...]` classes, so the patterns spell out ranges).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEV = Path("/dev")
SYS_MODULE = Path("/sys/module")
CONTROL_NODES = ("nvidiactl", "nvidia-uvm")
# Every name in /dev that gives access to a GPU (or to GPU-adjacent control), in any mode.
GPU_NODE_RE = re.compile(
    r"^(nvidia\d+|nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia-modeset|nvidia-caps|dri|kfd)$"
)


def run_devices(minor: int) -> tuple[Path, ...]:
    """The nodes a run on device `minor` may open: the control nodes and its own GPU."""
    return tuple(DEV / name for name in (*CONTROL_NODES, f"nvidia{minor}"))


def hidden_nodes(dev_entries: tuple[str, ...], allowed: tuple[Path, ...]) -> tuple[Path, ...]:
    """GPU nodes present on the host (names in /dev) that a run must not see."""
    keep = {p.name for p in allowed}
    return tuple(DEV / name for name in sorted(dev_entries) if GPU_NODE_RE.match(name) and name not in keep)


def _class_without(char: str) -> str:
    """A glob bracket class of every module-name character except `char`."""
    out = ""
    for lo, hi in (("a", "z"), ("A", "Z"), ("0", "9")):
        if lo <= char <= hi:
            if char > lo:
                out += lo if chr(ord(char) - 1) == lo else f"{lo}-{chr(ord(char) - 1)}"
            if char < hi:
                out += hi if chr(ord(char) + 1) == hi else f"{chr(ord(char) + 1)}-{hi}"
        else:
            out += f"{lo}-{hi}"
    return f"[{out}_]"


def hidden_modules(keep_prefix: str = "nvidia") -> tuple[Path, ...]:
    """Glob patterns covering every /sys/module entry whose name does not start with keep_prefix."""
    patterns = [
        SYS_MODULE / f"{keep_prefix[:k]}{_class_without(keep_prefix[k])}*" for k in range(len(keep_prefix))
    ]
    patterns += [SYS_MODULE / keep_prefix[:k] for k in range(1, len(keep_prefix))]  # "n", "nv", ... exactly
    return tuple(patterns)


def gpu_hidden(dev_entries: tuple[str, ...], allowed: tuple[Path, ...]) -> tuple[Path, ...]:
    """Everything a GPU run's jail blacklists beyond the CPU jail's list."""
    return hidden_nodes(dev_entries, allowed) + hidden_modules()


@dataclass(frozen=True)
class GpuDevice:
    """What a GPU jail factory needs: which device, its nodes, what to hide, what to share."""

    index: int
    uuid: str
    nodes: tuple[Path, ...]
    hidden: tuple[Path, ...]
    mps_pipe_dir: Path | None = None  # the MPS daemon's sockets, when runs join it


def gpu_device(
    index: int, uuid: str, minor: int, dev_dir: Path = DEV, mps_pipe_dir: Path | None = None
) -> GpuDevice:
    """Look at the host's /dev once and describe the jail of one device."""
    nodes = run_devices(minor)
    dev_entries = tuple(os.listdir(dev_dir)) if dev_dir.is_dir() else ()
    return GpuDevice(
        index=index, uuid=uuid, nodes=nodes, hidden=gpu_hidden(dev_entries, nodes), mps_pipe_dir=mps_pipe_dir
    )
