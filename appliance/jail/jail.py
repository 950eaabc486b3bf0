"""One jail: a run directory plus a verified firejail process running the driver.

`JailFactory.launch()` makes a jail in an explicit order:
  1. create the run directory (owned by the sandbox uid),
  2. render the spec to a firejail argv (pure),
  3. start firejail as the sandbox uid with a clean environment,
  4. wait for the driver's `ready` event and verify its self-check,
and `Jail.destroy()` undoes all of it, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import JailFailure
from appliance.jail import checks
from appliance.jail.firejail import launcher_env, render_argv
from appliance.jail.host import HostFacts
from appliance.jail.process import Event, JailProcess
from appliance.jail.spec import JailLimits, JailSpec, jail_env
from appliance.jail.workdir import RunDirs
from appliance.settings import Settings

log = logging.getLogger("appliance.jail")

READY_TIMEOUT_S = 60.0


@dataclass
class Jail:
    """A started, verified jail. Single-use unless a session keeps it."""

    id: str
    workdir: Path
    process: JailProcess
    dirs: RunDirs
    created: float = field(default_factory=time.monotonic)
    check: dict[str, Any] = field(default_factory=dict)
    preload_ms: int = 0
    _destroyed: bool = False

    @property
    def alive(self) -> bool:
        return not self._destroyed and self.process.returncode is None

    async def destroy(self, grace_s: float = 0.0) -> None:
        """Kill every process of the jail, reap them, and remove the run directory."""
        if self._destroyed:
            return
        self._destroyed = True
        try:
            await self.process.kill(grace_s)
        finally:
            await asyncio.to_thread(self.dirs.remove, self.workdir)


class JailFactory:
    """Makes jails for one server: holds the settings and host facts every spec needs."""

    def __init__(self, settings: Settings, host: HostFacts, runtime: Path, dirs: RunDirs) -> None:
        self.settings = settings
        self.host = host
        self.runtime = runtime
        self.dirs = dirs
        self.expected = checks.Expected(uid=host.uid, host_pid_ns=host.pid_ns, host_net_ns=host.net_ns)
        self._env = jail_env(settings, settings.python, runtime)
        self._readable = tuple(_python_roots(settings.python)) + (runtime,)
        self.spawned = 0

    def spec(self, workdir: Path) -> JailSpec:
        s = self.settings
        return JailSpec(
            workdir=workdir,
            uid=self.host.uid,
            gid=self.host.gid,
            python=s.python,
            driver=self.runtime / "driver.py",
            limits=JailLimits(
                memory_mb=s.memory_mb, max_procs=s.max_procs, file_mb=s.max_file_mb,
                open_files=s.max_open_files,
            ),
            readable=self._readable,
            root_entries=self.host.root_entries,
            run_entries=self.host.run_entries,
            env=self._env,
        )

    async def launch(self) -> Jail:
        """Start and verify a new jail, or raise JailFailure (and leave nothing behind)."""
        jail_id = secrets.token_hex(8)
        workdir = await asyncio.to_thread(self.dirs.create, jail_id)
        spec = self.spec(workdir)
        try:
            process = await JailProcess.spawn(
                lambda fd: render_argv(spec, fd, self.host.firejail),
                uid=self.host.run_as_uid, gid=self.host.gid if self.host.run_as_uid is not None else None,
                env=launcher_env(), max_event_bytes=self.settings.max_output_bytes + 65536,
            )
        except OSError as exc:
            await asyncio.to_thread(self.dirs.remove, workdir)
            raise JailFailure(f"could not start firejail: {exc}") from exc
        self.spawned += 1
        jail = Jail(id=jail_id, workdir=workdir, process=process, dirs=self.dirs)
        try:
            ready = await asyncio.wait_for(self._await_ready(jail), READY_TIMEOUT_S)
        except (TimeoutError, JailFailure) as exc:
            await jail.destroy()
            if isinstance(exc, JailFailure):
                raise
            raise JailFailure("jail did not become ready in time") from exc
        except BaseException:
            await jail.destroy()
            raise
        found = checks.problems(ready.get("check"), self.expected)
        if found:
            await jail.destroy()
            log.error("jail refused: self-check failed", extra={"problems": found, "jail": jail_id})
            raise JailFailure("the jail failed its self-check; the run was refused")
        jail.check = ready["check"]
        jail.preload_ms = int(ready.get("preload_ms", 0))
        failed = ready.get("preload_failed")
        if failed:
            log.warning("preload failed", extra={"modules": failed})
        return jail

    async def _await_ready(self, jail: Jail) -> dict[str, Any]:
        stderr: list[str] = []
        while True:
            item = await jail.process.items.get()
            if isinstance(item, Event) and item.body.get("ev") == "ready":
                return item.body
            if hasattr(item, "text"):
                stderr.append(item.text)
                continue
            if not isinstance(item, Event):
                detail = "".join(stderr).strip()[-500:]
                log.error("jail exited before ready", extra={"output": detail, "jail": jail.id})
                raise JailFailure("the jail exited before it was ready")


def _python_roots(python: Path) -> list[Path]:
    """The directories the jail's interpreter needs besides /usr: its virtualenv, if any."""
    venv = python.parent.parent
    if (venv / "pyvenv.cfg").exists():
        return [venv]
    return []
