"""The jail spec renders to a firejail argv by a pure function: checked without spawning."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from appliance.sandbox.firejail import (
    accounts_argv,
    bind_table,
    binds_argv,
    drop_argv,
    launcher_env,
    render_argv,
)
from appliance.sandbox.jail import own_hooks
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


def test_the_launch_binds_the_prepared_etc_read_only_then_the_accounts_and_the_workspace() -> None:
    table = bind_table(Path("/t/passwd"), Path("/t/group"), Path("/t/run 1\\x"), Path("/t/srv/etc"))
    assert table.splitlines() == [
        "/t/srv/etc /etc none bind,ro 0 0",
        "/t/passwd /etc/passwd none bind 0 0",
        "/t/group /etc/group none bind 0 0",
        "/t/run\\0401\\134x /workspace none bind 0 0",  # fstab's escapes: a path is one field
    ]
    assert "/etc " not in bind_table(Path("/t/passwd"), Path("/t/group"), Path("/t/run"))
    then = drop_argv(1001, 1001)
    prefix = binds_argv(Path("/t/srv/abc.binds"), then)
    assert prefix[:4] == ["unshare", "--mount", "--propagation=private", "--"]
    assert (
        prefix[6] == 'mount --all --fstab "$1" && shift && unset PWD && exec "$@"'
    )  # a failed bind runs nothing
    assert prefix[7:9] == ["sh", "/t/srv/abc.binds"]
    assert prefix[9:] == then


@pytest.mark.host
def test_mount_reads_the_bind_table_as_written(tmp_path: Path) -> None:
    """One mount(8) makes every bind of the table, in order, read-only where it says, whatever
    the paths hold (here a space and a backslash)."""
    if os.geteuid() != 0:
        pytest.skip("binds need root")
    source, target = tmp_path / "a dir\\x", tmp_path / "target"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "f").write_text("etc")
    other = tmp_path / "other"
    other.mkdir()
    (other / "g").write_text("file\n")
    target.mkdir()
    table = tmp_path / "t.binds"
    lines = bind_table(Path("/unused"), Path("/unused"), Path("/unused"), source).splitlines()[:1]
    lines = [lines[0].replace(" /etc ", f" {target} "), f"{other / 'g'} {target / 'sub' / 'f'} none bind 0 0"]
    table.write_text("\n".join(lines) + "\n")
    check = f"cat {target}/sub/f; touch {target}/new 2>/dev/null && echo writable || echo read-only"
    out = subprocess.run(binds_argv(table, ["sh", "-c", check]), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["file", "read-only"], out


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


def test_only_the_appliances_own_editable_hooks_are_hidden_from_jails(tmp_path: Path) -> None:
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    names = [
        "__editable__.appliance-0.1.0.pth",
        "__editable__.appliance_client-0.1.0.pth",
        "__editable__.appliance_extras-1.0.pth",  # someone else's package
        "__editable__.mypkg-1.0.pth",
        "distutils-precedence.pth",
    ]
    for name in names:
        (site / name).write_text("import os\n")
    assert own_hooks(tmp_path / "bin" / "python") == (site / names[0], site / names[1])
    assert own_hooks(Path("/usr/bin/python3")) == ()  # no virtualenv: nothing of ours
