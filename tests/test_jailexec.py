"""The argv that joins a command into a live jail, and how a command's end is told (pure)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from appliance.sandbox.jailexec import Ended, JoinSpec, command_argv
from appliance.sandbox.spec import JailLimits

LIMITS = JailLimits(memory_mb=512, max_procs=64, file_mb=100, open_files=1024)


def spec(as_root: bool = True, gpu: bool = False) -> JoinSpec:
    return JoinSpec(
        firejail="/usr/bin/firejail",
        uid=1005,
        gid=1005,
        as_root=as_root,
        accounts=(Path("/run/a/passwd"), Path("/run/a/group")) if as_root else None,
        workdir=Path("/run/a/jail"),
        env=(("HOME", "/workspace"), ("PATH", "/usr/bin")),
        limits=LIMITS,
        gpu=gpu,
    )


def test_the_join_runs_as_the_jail_in_its_cgroup_with_its_limits_and_only_its_env() -> None:
    argv = command_argv(
        spec(),
        4242,
        [Path("/cg/pids/j/commands/cgroup.procs")],
        ["/bin/bash", "-c", "x"],
        {"A": "1", "PATH": "/bin"},
        "/workspace/sub",
    )
    text = " ".join(argv)
    # Outermost first: the OOM score, the cgroup join, the accounts, the uid, the rlimits.
    assert text.index("oom_score_adj") < text.index("/cg/pids/j/commands/cgroup.procs")
    # One shell writes the OOM score and joins the group (`oom_join_argv`): no second shell.
    assert argv[:2] == ["sh", "-c"] and "oom_score_adj" in argv[2]
    assert argv[3:6] == ["sh", "1", "/cg/pids/j/commands/cgroup.procs"]
    assert text.index("cgroup.procs") < text.index("/run/a/passwd") < text.index("--reuid=1005")
    assert text.index("--reuid=1005") < text.index("prlimit") < text.index("--join=4242")
    assert "--nproc=64" in argv and "--nofile=1024" in argv and f"--as={512 << 20}" in argv
    inside = argv[argv.index("--join=4242") + 1 :]
    assert inside[:4] == ["env", "-i", "-C", "/workspace/sub"]
    # The jail's env, then the command's over it; then the command, untouched.
    assert inside[4:7] == ["HOME=/workspace", "PATH=/bin", "A=1"]
    assert inside[7:] == ["/bin/bash", "-c", "x"]


def test_a_gpu_jail_gets_no_address_space_limit_and_a_plain_server_no_root_steps() -> None:
    assert not any(
        a.startswith("--as=") for a in command_argv(spec(gpu=True), 1, [], ["true"], {}, "/workspace")
    )
    plain = command_argv(spec(as_root=False), 1, [], ["true"], {}, "/workspace")
    assert plain[0] == "prlimit" and "setpriv" not in plain and "unshare" not in plain


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["A=b"], {}), ([""], {}), ([], {}), (["true"], {"": "x"}), (["true"], {"A=B": "x"})],
)
def test_what_env_would_misread_is_refused(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"program|environment variable"):
        command_argv(spec(), 1, [], argv, env, "/workspace")


def test_an_end_reads_as_envd_says_it() -> None:
    assert Ended(3, None).status == "exit status 3"
    assert Ended(137, signal.SIGKILL).status == "signal: killed"
    assert Ended(143, signal.SIGTERM).status == "signal: terminated"
