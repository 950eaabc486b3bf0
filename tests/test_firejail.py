"""Each section of the firejail argv, rendered alone from a spec: pure functions, no spawning."""

from __future__ import annotations

from pathlib import Path

from appliance.sandbox import firejail
from appliance.sandbox.spec import ETC_FILES, JailLimits
from tests.test_jail_spec import make_spec

MIB = 1024 * 1024


def test_the_argv_is_its_sections_in_their_fixed_order() -> None:
    spec = make_spec(gpu=True, netns="ns", dns=("10.0.0.53",), nice=5)
    assert firejail.render_argv(spec, 9, "/usr/bin/firejail") == [
        "/usr/bin/firejail",
        "--quiet",
        "--noprofile",
        *firejail.privileges_argv(),
        *firejail.seccomp_argv(),
        *firejail.namespaces_argv(spec),
        *firejail.mounts_argv(spec),
        *firejail.devices_argv(spec),
        *firejail.readable_argv(spec),
        *firejail.resources_argv(spec),
        *firejail.lifecycle_argv(9),
        *firejail.env_argv(spec),
        *firejail.command_argv(spec, 9),
    ]


def test_privileges_are_dropped_whole() -> None:
    assert firejail.privileges_argv() == ["--noroot", "--caps.drop=all", "--nonewprivs"]


def test_seccomp_adds_io_uring_to_the_default_list_and_blocks_other_architectures() -> None:
    assert firejail.seccomp_argv() == [
        "--seccomp=io_uring_setup,io_uring_enter,io_uring_register",
        "--seccomp.block-secondary",
    ]


def test_a_jail_has_no_network_unless_it_starts_in_an_egress_namespace() -> None:
    assert firejail.namespaces_argv(make_spec()) == ["--restrict-namespaces", "--ipc-namespace", "--net=none"]
    egress = make_spec(netns="appliance-eg1", dns=("10.0.0.53", "10.0.0.54"))
    assert firejail.namespaces_argv(egress) == [
        "--restrict-namespaces",
        "--ipc-namespace",
        "--dns=10.0.0.53",
        "--dns=10.0.0.54",
    ]


def test_mounts_make_the_run_directory_home_and_hide_the_rest_of_the_host() -> None:
    spec = make_spec()
    argv = firejail.mounts_argv(spec)
    assert argv[:5] == [
        "--private=/tmp/appliance/srv-1/abc",
        "--private-cwd=/workspace",
        "--private-tmp",
        "--private-dev",
        f"--private-etc={','.join(ETC_FILES)}",
    ]
    assert argv[5:] == [f"--blacklist={path}" for path in spec.hidden]
    assert "--blacklist=/home" in argv and "--blacklist=/run/secrets" in argv


def test_a_prepared_etc_replaces_the_per_jail_copy_and_hides_what_firejail_reads_there() -> None:
    spec = make_spec(etc=Path("/run/appliance/srv-1/etc"))
    argv = firejail.mounts_argv(spec)
    assert not [a for a in argv if a.startswith("--private-etc")]
    assert argv[:6] == [
        "--private=/tmp/appliance/srv-1/abc",
        "--private-cwd=/workspace",
        "--private-tmp",
        "--private-dev",
        "--blacklist=/etc/firejail",
        "--blacklist=/etc/login.defs",
    ]
    assert argv[6:] == [f"--blacklist={path}" for path in spec.hidden]
    # The rest of the jail is the same jail.
    plain = firejail.render_argv(make_spec(), 9)
    prepared = firejail.render_argv(spec, 9)
    differs = set(plain) ^ set(prepared)
    assert differs == {
        f"--private-etc={','.join(ETC_FILES)}",
        "--blacklist=/etc/firejail",
        "--blacklist=/etc/login.defs",
    }


def test_a_cpu_jail_has_no_gpu_nodes_and_a_gpu_jail_only_its_own() -> None:
    assert firejail.devices_argv(make_spec()) == ["--no3d"]
    gpu = make_spec(gpu=True, gpu_hidden=(Path("/dev/nvidia1"),), gpu_shared=(Path("/tmp/mps-pipe"),))
    assert firejail.devices_argv(gpu) == [
        "--noblacklist=/sys/module",
        "--blacklist=/dev/nvidia1",
        "--whitelist=/tmp/mps-pipe",
    ]


def test_the_environment_and_runtime_are_readable_and_read_only() -> None:
    assert firejail.readable_argv(make_spec()) == [
        "--whitelist=/srv/venv",
        "--read-only=/srv/venv",
        "--whitelist=/tmp/appliance/runtime-x",
        "--read-only=/tmp/appliance/runtime-x",
    ]
    hook = Path("/srv/venv/lib/python3.11/site-packages/__editable__.appliance-0.1.0.pth")
    assert firejail.readable_argv(make_spec(hooks_hidden=(hook,)))[-1] == f"--blacklist={hook}"


def test_resources_render_with_their_units_and_a_gpu_jail_has_no_address_space_limit() -> None:
    limits = JailLimits(memory_mb=512, max_procs=32, file_mb=10, open_files=256)
    assert firejail.resources_argv(make_spec(limits=limits, nice=7)) == [
        f"--rlimit-as={512 * MIB}",
        "--nice=7",
        "--rlimit-nproc=32",
        f"--rlimit-fsize={10 * MIB}",
        "--rlimit-nofile=256",
    ]
    assert not any(
        a.startswith("--rlimit-as") for a in firejail.resources_argv(make_spec(limits=limits, gpu=True))
    )
    unbounded = JailLimits(memory_mb=None, max_procs=32, file_mb=10, open_files=256)
    assert not any(a.startswith("--rlimit-as") for a in firejail.resources_argv(make_spec(limits=unbounded)))


def test_the_event_pipe_is_kept_and_leftovers_die_with_the_driver() -> None:
    assert firejail.lifecycle_argv(5) == [
        "--keep-fd=5",
        "--deterministic-exit-code",
        "--deterministic-shutdown",
    ]


def test_the_environment_is_only_the_specs() -> None:
    assert firejail.env_argv(make_spec(env=(("A", "1"), ("B", "x=y")))) == ["--env=A=1", "--env=B=x=y"]


def test_the_driver_runs_isolated_and_unbuffered_with_its_event_fd() -> None:
    assert firejail.command_argv(make_spec(), 4) == [
        "/srv/venv/bin/python",
        "-I",
        "-u",
        "/tmp/appliance/runtime-x/driver.py",
        "4",
    ]
