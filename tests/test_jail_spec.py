"""The jail spec renders to a firejail argv by a pure function: checked without spawning."""

from __future__ import annotations

from pathlib import Path

from appliance.sandbox.firejail import accounts_argv, drop_argv, launcher_env, render_argv
from appliance.sandbox.spec import JailLimits, JailSpec, jail_env
from appliance.settings import Settings

SETTINGS = Settings(python=Path("/srv/venv/bin/python"))


def make_spec(**over: object) -> JailSpec:
    fields: dict[str, object] = dict(
        workdir=Path("/tmp/appliance/srv-1/abc"),
        uid=1001,
        gid=1001,
        python=Path("/srv/venv/bin/python"),
        driver=Path("/tmp/appliance/runtime-x/driver.py"),
        limits=JailLimits(memory_mb=1024, max_procs=64, file_mb=100, open_files=1024),
        readable=(Path("/srv/venv"), Path("/tmp/appliance/runtime-x")),
        root_entries=("bin", "etc", "home", "opt", "root", "run", "srv", "tmp", "usr", "var", "work"),
        run_entries=("firejail", "secrets", "user"),
        env=jail_env(SETTINGS, Path("/srv/venv/bin/python"), Path("/tmp/appliance/runtime-x"), ("numpy",)),
    )
    fields.update(over)
    return JailSpec(**fields)  # type: ignore[arg-type]


def test_the_argv_drops_every_privilege_and_the_network() -> None:
    argv = render_argv(make_spec(), events_fd=7)
    for flag in (
        "--noprofile",
        "--noroot",
        "--caps.drop=all",
        "--nonewprivs",
        "--net=none",
        "--private-dev",
        "--private-tmp",
        "--restrict-namespaces",
        "--ipc-namespace",
    ):
        assert flag in argv
    seccomp = [a for a in argv if a.startswith("--seccomp=")]
    assert seccomp == [
        "--seccomp=io_uring_setup,io_uring_enter,io_uring_register"
    ]  # on top of the default list


def test_the_minimal_accounts_are_mounted_before_the_uid_is_dropped() -> None:
    prefix = accounts_argv(Path("/t/passwd"), Path("/t/group"), Path("/t/run"), drop_argv(1001, 1001))
    assert prefix[:4] == ["unshare", "--mount", "--propagation=private", "--"]
    script = prefix[6]
    assert (
        script.index("/etc/passwd")
        < script.index("/etc/group")
        < script.index('"$3" /workspace')
        < script.index('exec env -u PWD "$@"')
    )
    assert prefix[8:11] == ["/t/passwd", "/t/group", "/t/run"]  # the run directory: the home firejail checks
    assert prefix[11:] == [
        "setpriv",
        "--reuid=1001",
        "--regid=1001",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
    ]


def test_a_prepared_etc_is_bound_read_only_over_etc_before_the_accounts() -> None:
    then = drop_argv(1001, 1001)
    prefix = accounts_argv(Path("/t/passwd"), Path("/t/group"), Path("/t/run"), then, Path("/t/srv/etc"))
    script = prefix[6]
    assert (
        script.index('mount --bind "$4" /etc ')
        < script.index("mount -o remount,bind,ro /etc")
        < script.index('"$1" /etc/passwd')
        < script.index('"$2" /etc/group')
        < script.index("shift 4")
        < script.index('exec env -u PWD "$@"')
    )
    assert prefix[7:12] == ["sh", "/t/passwd", "/t/group", "/t/run", "/t/srv/etc"]
    assert prefix[12:] == then
    assert "/etc " not in accounts_argv(Path("/t/passwd"), Path("/t/group"), Path("/t/run"), then)[6]


def test_the_run_directory_becomes_workspace_and_cwd() -> None:
    argv = render_argv(make_spec(), events_fd=7)
    assert "--private=/tmp/appliance/srv-1/abc" in argv
    assert "--private-cwd=/workspace" in argv


def test_limits_render_with_their_units() -> None:
    argv = render_argv(make_spec(), events_fd=7)
    assert "--rlimit-as=1073741824" in argv
    assert (
        "--rlimit-nproc=64" in argv and "--rlimit-fsize=104857600" in argv and "--rlimit-nofile=1024" in argv
    )
    no_as = render_argv(make_spec(limits=JailLimits(None, 64, 100, 1024)), events_fd=7)
    assert not [a for a in no_as if a.startswith("--rlimit-as")]


def test_everything_at_the_top_level_but_system_dirs_is_hidden() -> None:
    spec = make_spec()
    hidden = {str(p) for p in spec.hidden}
    assert hidden == {"/home", "/opt", "/root", "/var", "/work", "/run/secrets", "/run/user"}
    argv = render_argv(spec, events_fd=7)
    assert "--blacklist=/root" in argv and "--blacklist=/run/secrets" in argv
    assert "--blacklist=/srv" not in argv  # holds the python env, which is whitelisted instead
    assert "--whitelist=/srv/venv" in argv and "--read-only=/srv/venv" in argv


def test_the_environment_is_built_from_scratch() -> None:
    argv = render_argv(make_spec(), events_fd=7)
    env = dict(a[len("--env=") :].split("=", 1) for a in argv if a.startswith("--env="))
    assert env["HOME"] == "/workspace" and env["PATH"].startswith("/srv/venv/bin:")
    assert not {k for k in env if "TOKEN" in k or "SECRET" in k or k.startswith("AWS")}
    assert env["APPLIANCE_PRELOAD"] == "numpy"  # the jail's preload profile
    assert launcher_env()["container"] == "docker"


def test_the_driver_is_the_program_and_gets_its_event_fd() -> None:
    argv = render_argv(make_spec(), events_fd=7)
    assert "--keep-fd=7" in argv
    assert argv[-5:] == ["/srv/venv/bin/python", "-I", "-u", "/tmp/appliance/runtime-x/driver.py", "7"]
    assert "--" not in argv  # firejail 0.9.72 would run the command through the login shell


def test_rendering_is_deterministic() -> None:
    assert render_argv(make_spec(), 3) == render_argv(make_spec(), 3)


def test_a_given_path_in_run_keeps_only_its_own_entry_visible() -> None:
    mps = make_spec(
        run_entries=("firejail", "nvidia-mps", "secrets", "user"),
        gpu=True,
        gpu_shared=(Path("/run/nvidia-mps"),),
    )
    hidden = {str(p) for p in mps.hidden}
    assert "/run/secrets" in hidden and "/run/user" in hidden
    assert "/run/nvidia-mps" not in hidden and "/run/firejail" not in hidden
