"""The startup probe of the model tools: what the jails' llama.cpp and whisper.cpp can do.

Runs `appliance.inside.tools.backends` once in a child process of SANDBOX_PYTHON (the jails'
interpreter, with the staged in-jail runtime first on its path), so the answer is about
the bindings jailed code gets, both imported in one process as a warm GPU jail imports
them. Reported under /readyz's `tools`; in GPU mode, two ggml builds under one SONAME
(see appliance.inside.tools.backends) make the appliance not ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from appliance.core.tasks import TaskScope

log = logging.getLogger("appliance.runtime.toolprobe")

PROBE_TIMEOUT_S = 120.0
_CODE = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); from appliance.inside.tools.backends import probe; "
    "print(json.dumps(probe()))"
)


def run_probe(python: Path, runtime: Path, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The bindings' report, or {"error": why} when the probe itself could not run."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    try:
        # S603: the jails' python, our probe code
        proc = subprocess.run(  # noqa: S603
            [str(python), "-I", "-c", _CODE, str(runtime)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            cwd="/",
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"the tools probe could not run: {type(exc).__name__}: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # Importing both bindings crashed the process (two ggml builds can do that): say so.
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return {
            "error": f"importing llama_cpp and pywhispercpp in one process failed (exit {proc.returncode}): "
            + " | ".join(tail)
        }
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return {"error": f"the tools probe printed no report: {lines[-1][:200]!r}"}
    return report if isinstance(report, dict) else {"error": "the tools probe printed no report"}


class ToolProbe:
    """Runs the probe once in the background; `report()` and `problems()` read its answer."""

    def __init__(self, python: Path, gpu: bool) -> None:
        self.python = python
        self.gpu = gpu
        self.result: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, runtime: Path, owner: TaskScope) -> None:
        """Begin probing (in a thread: the imports take a second or more), as a task of `owner`."""

        async def probe() -> None:
            self.result = await asyncio.to_thread(run_probe, self.python, runtime)
            log.info("model tools probed", extra={"tools": self.result})

        self._task = owner.spawn(probe(), name="tool-probe")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def report(self) -> dict[str, Any]:
        """/readyz's `tools`: per binding {available, gpu_offload, ...}, or {"probing": true}."""
        if self.result is None:
            return {"probing": True}
        return self.result

    def problems(self) -> list[str]:
        """GPU mode: the bindings must load side by side, each on its own ggml."""
        if not self.gpu or self.result is None:
            return []
        if "error" in self.result:
            return [str(self.result["error"])]
        return [f"model tools: {c}" for c in self.result.get("ggml_conflicts") or []]


def wanted(models_dir: Path | None, gpu: bool) -> bool:
    """Probe only where the tools can be used: GPU mode, or a models directory configured."""
    return gpu or (models_dir is not None and os.path.isdir(models_dir))
