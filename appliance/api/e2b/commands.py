"""A sandbox's commands (E2B's `sandbox.commands`): a bounded table of processes in its jail.

Each command runs in the jail of the sandbox's default context, beside its interpreter
(appliance.sandbox.jailexec says how, and why a join). A sandbox holds at most
MAX_COMMANDS running at once; its commands end when it does (`close`), and with its jail
whatever they left. Commands are named by a number of the table's own (E2B's "pid"): the
jail's PIDs are its own business, and a number never names another sandbox's process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from appliance.core.tasks import TaskScope
from appliance.sandbox.jail import Jail
from appliance.sandbox.jailexec import JailCommand

MAX_COMMANDS = 32  # running commands per sandbox
FIRST_PID = 1000
WORKDIR = "/workspace"
HOME_ALIAS = "/home/user"  # E2B's home: the jail's working directory here (docs/e2b.md)


class TableFull(Exception):
    """The sandbox runs MAX_COMMANDS commands already."""


@dataclass
class Command:
    pid: int
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    tag: str | None
    process: JailCommand


@dataclass
class Table:
    """One sandbox's commands, running or just ended (pruned at each look)."""

    commands: dict[int, Command] = field(default_factory=dict)
    next_pid: int = FIRST_PID
    closed: bool = False

    def running(self) -> list[Command]:
        self._prune()
        return list(self.commands.values())

    def find(self, pid: int | None = None, tag: str | None = None) -> Command | None:
        """A running command by number or tag."""
        for command in self.running():
            if (pid is not None and command.pid == pid) or (tag is not None and command.tag == tag):
                return command
        return None

    def _prune(self) -> None:
        for pid in [pid for pid, c in self.commands.items() if not c.process.running]:
            del self.commands[pid]

    def reserve(self) -> int:
        """A number for a command about to start; TableFull when the sandbox runs enough."""
        if self.closed:
            raise TableFull("the sandbox is ending")
        if len(self.running()) >= MAX_COMMANDS:
            raise TableFull(f"this sandbox runs {MAX_COMMANDS} commands already; wait for one or kill one")
        pid = self.next_pid
        self.next_pid += 1
        return pid

    async def close(self) -> None:
        """End every command (the sandbox is ending)."""
        self.closed = True
        # Together: each close is bounded (`JailCommand.close`), and so is their sum then.
        await asyncio.gather(*(c.process.close() for c in self.commands.values()), return_exceptions=True)
        self.commands.clear()


def jail_path(path: str | None) -> str:
    """A working directory as E2B names it, in the jail: /home/user is /workspace, and a
    relative path is taken from there."""
    if not path:
        return WORKDIR
    if path == HOME_ALIAS or path.startswith(HOME_ALIAS + "/"):
        return WORKDIR + path[len(HOME_ALIAS) :]
    if not path.startswith("/"):
        return f"{WORKDIR}/{path}"
    return path


async def start(  # noqa: PLR0913 (the command as the SDK sends it, and where it runs)
    table: Table,
    jail: Jail,
    argv: list[str],
    envs: dict[str, str],
    cwd: str | None,
    tag: str | None,
    stdin: bool,
    tasks: TaskScope,
) -> Command:
    """Start a command in the jail and enter it in the table. TableFull, ValueError (a
    command that cannot be run as given) or JailFailure."""
    pid = table.reserve()
    where = jail_path(cwd)
    process = await jail.start_command(argv, envs, where, stdin, tasks)
    if table.closed:  # the sandbox ended while the command started
        await process.close()
        raise TableFull("the sandbox is ending")
    command = Command(pid, argv[0], argv[1:], dict(envs), where, tag, process)
    table.commands[pid] = command
    return command
