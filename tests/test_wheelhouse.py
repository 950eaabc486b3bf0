"""Packages on demand from an operator's wheelhouse (SANDBOX_WHEELHOUSE): wheels built by the
test, a real server, real jails, real pip (offline, from the wheelhouse only)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.sandbox.wheels import stage_wheel_cache
from appliance_client.client import AsyncClient, Execution
from tests.support import Server, start_server


def build_wheel(  # noqa: PLR0913 (the wheel's metadata fields, with defaults)
    folder: Path,
    name: str,
    version: str,
    module: str,
    requires: tuple[str, ...] = (),
    tag: str = "py3-none-any",
    extra: dict[str, str] | None = None,
) -> Path:
    """A minimal valid wheel: one module, METADATA, WHEEL and RECORD (what pip checks)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": module,
        **(extra or {}),
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: {n}\nVersion: {v}\n{r}\n".format(
            n=name, v=version, r="".join(f"Requires-Dist: {r}\n" for r in requires)
        ),
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    wheel = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    os.chmod(wheel, 0o644)
    return wheel


@pytest.fixture(scope="module")
def wheelhouse() -> Iterator[Path]:
    # Under /tmp with 0755: the sandbox uid must reach it (tmp_path's ancestors are root-only).
    root = Path(tempfile.mkdtemp(prefix="appliance-wheels-", dir="/tmp"))
    os.chmod(root, 0o755)
    build_wheel(root, "tinydep", "1.0", "WORD = 'dep'\n")
    build_wheel(
        root, "tinypkg", "2.0", "import tinydep\nVALUE = 'pkg+' + tinydep.WORD\n", requires=("tinydep",)
    )
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("wheels"), SANDBOX_WHEELHOUSE=str(wheelhouse))
    yield srv
    srv.stop()


async def run(server: Server, code: str, **options: object) -> Execution:
    async with AsyncClient(server.url) as c:
        return await c.execute(code, **options)  # type: ignore[arg-type]


class TestInstall:
    async def test_pip_install_then_import_in_the_same_cell(self, served: Server) -> None:
        ex = await run(served, "%pip install tinypkg\nimport tinypkg\nprint(tinypkg.VALUE)")
        assert ex.status == "ok", ex.frames
        assert ex.stdout.splitlines()[-1] == "pkg+dep"
        assert "tinypkg-2.0" in ex.stdout and "tinydep-1.0" in ex.stdout

    async def test_a_second_run_takes_the_shared_cache_and_installs_nothing(self, served: Server) -> None:
        code = (
            "%pip install tinypkg\nimport os, tinypkg\nprint(tinypkg.__file__.startswith(os.environ['APPLIANCE_WHEEL_CACHE']))\n"
            "print(os.path.exists('.appliance/site-packages'))"
        )
        for _ in range(2):
            ex = await run(served, code)
            assert ex.status == "ok", ex.frames
            assert "(from the appliance's wheel cache)" in ex.stdout
            assert ex.stdout.splitlines()[-2:] == ["True", "False"]  # imported from the cache, nothing copied

    async def test_real_pip_installs_offline_into_the_runs_own_site_dir(self, served: Server) -> None:
        ex = await run(
            served,
            "!pip install --force-reinstall tinypkg\nimport tinypkg, os\n"
            "print(tinypkg.__file__)\nprint(sorted(os.listdir('.appliance/site-packages')))",
        )
        assert ex.status == "ok", (ex.stdout, ex.stderr)
        assert "Successfully installed tinydep-1.0 tinypkg-2.0" in ex.stdout
        lines = ex.stdout.splitlines()
        assert lines[-2] == "/workspace/.appliance/site-packages/tinypkg.py"
        assert "tinypkg.py" in lines[-1] and "tinydep.py" in lines[-1]

    async def test_a_session_keeps_what_was_installed_for_later_cells_and_commands(
        self, served: Server
    ) -> None:
        async with AsyncClient(served.url) as c, c.session() as session:
            first = await session.execute("!pip install --no-deps tinydep")
            assert first.status == "ok" and "Successfully installed tinydep-1.0" in first.stdout, first.stderr
            later = await session.execute(
                "import tinydep\nprint(tinydep.WORD)\n!python -c 'import tinydep; print(1)'"
            )
            assert later.status == "ok" and later.stdout == "dep\n1\n", (later.stdout, later.stderr)

    async def test_a_package_missing_from_the_wheelhouse_ends_the_cell_with_an_error_naming_it(
        self, served: Server
    ) -> None:
        ex = await run(served, "%pip install requests tinypkg\nprint('went on')")
        assert ex.status == "error" and ex.stdout == "", ex.frames
        assert ex.error is not None and ex.error.name == "PipError"
        assert "not in the appliance's wheelhouse: requests;" in ex.error.value
        assert "The wheelhouse has: tinydep 1.0, tinypkg 2.0" in ex.error.value
        async with AsyncClient(served.url) as c, c.session() as session:
            await session.execute("%pip install nosuchpkg")
            after = await session.execute("print(_exit_code)")
        assert after.status == "ok" and after.stdout == "1\n"

    async def test_options_that_could_reach_elsewhere_are_refused(self, served: Server) -> None:
        ex = await run(served, "!pip install --index-url http://example.com/simple tinypkg")
        assert ex.status == "error" and ex.error is not None
        assert "unsupported option(s) --index-url" in ex.error.value

    async def test_pip_list_shows_the_runs_installs_and_what_the_wheelhouse_offers(
        self, served: Server
    ) -> None:
        ex = await run(served, "%pip list\n%pip install --no-deps tinydep\n%pip list")
        assert ex.status == "ok", (ex.stdout, ex.stderr)
        before, after = ex.stdout.split("Successfully installed", 1)
        assert "tinydep" not in before.split("%pip install can add")[0]
        assert re.search(r"^tinydep\s+1\.0$", after, re.M), after
        assert "%pip install can add, from the appliance's wheelhouse: tinydep 1.0, tinypkg 2.0" in after


class TestNeverWritableByAJail:
    async def test_the_jail_cannot_write_the_cache_or_the_wheelhouse(
        self, served: Server, wheelhouse: Path
    ) -> None:
        code = (
            "import os, json\ncache = os.environ['APPLIANCE_WHEEL_CACHE']\nresults = {}\n"
            f"targets = [cache, os.path.join(cache, 'tinydep-1.0'), {str(wheelhouse)!r}]\n"
            "for d in targets:\n"
            "    try:\n        open(os.path.join(d, 'planted.py'), 'w').write('x')\n"
            "        results[d] = 'written'\n"
            "    except OSError as exc:\n        results[d] = exc.strerror\n"
            "for f in [os.path.join(cache, 'manifest.json'), os.path.join(cache, 'tinydep-1.0', 'tinydep.py')]:\n"
            "    try:\n        open(f, 'a').write('#')\n        results[f] = 'written'\n"
            "    except OSError as exc:\n        results[f] = exc.strerror\n"
            "print(json.dumps(results))"
        )
        ex = await run(served, code)
        assert ex.status == "ok", ex.frames
        results = json.loads(ex.stdout)
        assert len(results) == 5 and "written" not in results.values(), results
        assert set(results.values()) <= {"Read-only file system", "Permission denied"}

    def test_the_cache_is_owned_by_the_server_and_not_group_or_world_writable(
        self, served: Server, wheelhouse: Path
    ) -> None:
        caches = list((Path(served.env.get("SANDBOX_TMP_ROOT", "/run")) / "appliance").glob("wheels-*"))
        assert caches
        for cache in caches:
            for path in [cache, *cache.rglob("*")]:
                info = path.lstat()
                assert info.st_uid == os.getuid() and not info.st_mode & 0o022, path


class TestStaging:
    def test_pure_wheels_are_unpacked_once_per_wheelhouse_content(self, tmp_path: Path) -> None:
        house = tmp_path / "house"
        house.mkdir()
        build_wheel(house, "alpha", "1.0", "A = 1\n", requires=("beta>=1", "gamma; extra == 'x'"))
        build_wheel(house, "beta", "1.0", "B = 1\n")
        build_wheel(house, "beta", "2.0", "B = 2\n")
        build_wheel(house, "native", "1.0", "N = 1\n", tag="cp311-cp311-linux_x86_64")
        build_wheel(house, "marked", "1.0", "M = 1\n", requires=("alpha; python_version < '4'",))
        first = stage_wheel_cache(house, tmp_path / "root")
        manifest = json.loads((first / "manifest.json").read_text())["packages"]
        assert manifest["alpha"] == {
            "name": "alpha",
            "version": "1.0",
            "path": "alpha-1.0",
            "requires": [{"name": "beta", "specifier": ">=1", "cached": False}],
            "cacheable": True,
        }  # beta has two versions: not cached
        assert (first / "alpha-1.0" / "alpha.py").read_text() == "A = 1\n"
        assert not manifest["beta"]["cacheable"]  # two versions: pip chooses
        assert not manifest["native"]["cacheable"] and not manifest["marked"]["cacheable"]
        assert stage_wheel_cache(house, tmp_path / "root") == first
        build_wheel(house, "delta", "1.0", "D = 1\n")
        assert stage_wheel_cache(house, tmp_path / "root") != first

    def test_a_requirements_version_range_is_judged_against_the_cached_version(self, tmp_path: Path) -> None:
        house = tmp_path / "house"
        house.mkdir()
        build_wheel(house, "lib", "1.5", "L = 1\n")
        build_wheel(house, "old_ok", "1.0", "A = 1\n", requires=("lib<2,>=1",))
        build_wheel(house, "wants_new", "1.0", "B = 1\n", requires=("Lib>=2",))
        build_wheel(house, "legacy", "1.0", "C = 1\n", requires=("lib (==1.5)",))
        build_wheel(house, "extras", "1.0", "D = 1\n", requires=("lib[fast]",))
        manifest = json.loads((stage_wheel_cache(house, tmp_path / "root") / "manifest.json").read_text())[
            "packages"
        ]
        assert manifest["old-ok"]["requires"] == [{"name": "lib", "specifier": "<2,>=1", "cached": True}]
        assert manifest["wants-new"]["requires"] == [{"name": "lib", "specifier": ">=2", "cached": False}]
        assert manifest["legacy"]["requires"] == [{"name": "lib", "specifier": "==1.5", "cached": True}]
        assert not manifest["extras"]["cacheable"]  # a dependency's extras: pip's judgement

    def test_a_wheel_with_a_path_outside_its_folder_is_not_unpacked(self, tmp_path: Path) -> None:
        house = tmp_path / "house"
        house.mkdir()
        build_wheel(house, "evil", "1.0", "E = 1\n", extra={"../../escaped.py": "x"})
        cache = stage_wheel_cache(house, tmp_path / "root")
        assert not json.loads((cache / "manifest.json").read_text())["packages"]["evil"]["cacheable"]
        assert not list(tmp_path.rglob("escaped.py"))


class TestOffByDefault:
    def test_a_wheelhouse_that_is_not_a_directory_stops_startup(self, tmp_path: Path) -> None:
        with pytest.raises(RuntimeError, match="SANDBOX_WHEELHOUSE: /nonexistent-wheels is not a directory"):
            start_server(tmp_path / "srv", SANDBOX_WHEELHOUSE="/nonexistent-wheels")


SMALL_DISK_MB = 8


@pytest.fixture(scope="module")
def bounded() -> Iterator[Server]:
    """A wheelhouse with a wheel whose install is bigger than the run's disk quota, and one
    that never finishes reading (a FIFO: what a wheelhouse on a hung network mount looks like)."""
    root = Path(tempfile.mkdtemp(prefix="appliance-wheels-big-", dir="/tmp"))
    os.chmod(root, 0o755)
    megabyte = "0" * 2**20
    # A platform wheel (not cacheable): real pip installs it. 24 files of 1 MiB, each under
    # SANDBOX_MAX_FILE_MB, 24 MiB in all: three times SANDBOX_MAX_DISK_MB.
    build_wheel(
        root,
        "bigpkg",
        "1.0",
        "BIG = 1\n",
        tag="py3-none-linux_x86_64",
        extra={f"bigpkg_data/blob{i}.txt": megabyte for i in range(24)},
    )
    os.mkfifo(root / "slowpkg-1.0-py3-none-any.whl", 0o644)
    tmp = Path(tempfile.mkdtemp(prefix="appliance-bounded-"))
    srv = start_server(tmp, SANDBOX_WHEELHOUSE=str(root), SANDBOX_MAX_DISK_MB=str(SMALL_DISK_MB))
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


class TestBoundedByTheRunsLimits:
    async def test_an_install_bigger_than_the_disk_quota_fails_at_the_quota(self, bounded: Server) -> None:
        # The run directory is a tmpfs of the quota's size (`runfs`): pip itself gets ENOSPC, and
        # the failed %pip ends the cell with an error (or, past the check, output_limit).
        ex = await run(bounded, "%pip install bigpkg", timeout_ms=60000)
        if ex.status == "output_limit":
            assert f"SANDBOX_MAX_DISK_MB ({SMALL_DISK_MB} MiB)" in (ex.message or ""), ex.message
        else:
            assert ex.status == "error" and "No space left on device" in ex.stderr, (ex.status, ex.stderr)
            assert "bigpkg" in str(ex.error), ex.error
        after = await run(bounded, "print('next run fine')")
        assert after.status == "ok" and after.stdout == "next run fine\n"

    async def test_an_install_that_does_not_finish_is_stopped_at_the_runs_time_limit(
        self, bounded: Server
    ) -> None:
        # pip's own start takes seconds on a loaded machine; slowpkg never finishes anyway.
        ex = await run(bounded, "%pip install slowpkg\nprint('AFTER-INSTALL')", timeout_ms=8000)
        assert ex.status == "timeout", (ex.status, ex.stdout, ex.stderr)
        assert "Looking in links" in ex.stdout, "pip itself was running when the time ran out"
        assert "AFTER-INSTALL" not in ex.stdout
        after = await run(bounded, "print('next run fine')")
        assert after.status == "ok" and after.stdout == "next run fine\n"


@pytest.fixture(scope="module")
def ranges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A wheelhouse whose wheels ask their dependency for version ranges: one the cache's only
    version meets, one it does not."""
    root = Path(tempfile.mkdtemp(prefix="appliance-wheels-ranges-", dir="/tmp"))
    os.chmod(root, 0o755)
    build_wheel(root, "rangedep", "1.0", "V = '1.0'\n")
    build_wheel(root, "wantsold", "1.0", "import rangedep\nV = rangedep.V\n", requires=("rangedep<2",))
    build_wheel(root, "wantsnew", "1.0", "import rangedep\nV = rangedep.V\n", requires=("rangedep>=2",))
    srv = start_server(tmp_path_factory.mktemp("ranges"), SANDBOX_WHEELHOUSE=str(root))
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


class TestVersionRanges:
    async def test_a_range_the_cached_version_meets_is_installed_from_the_cache(self, ranges: Server) -> None:
        ex = await run(ranges, "%pip install wantsold\nimport wantsold\nprint(wantsold.V)")
        assert ex.status == "ok", (ex.stdout, ex.stderr)
        assert "(from the appliance's wheel cache)" in ex.stdout and ex.stdout.splitlines()[-1] == "1.0"

    async def test_a_range_the_cache_cannot_meet_goes_to_pip_which_refuses_it(self, ranges: Server) -> None:
        # The cache used to install rangedep 1.0 for `rangedep>=2`; pip, from the wheelhouse,
        # finds no version that fits, as it would on any machine.
        ex = await run(ranges, "%pip install wantsnew\nprint('went on')", timeout_ms=60000)
        assert ex.status == "error" and ex.error is not None, (ex.stdout, ex.stderr)
        assert ex.error.name == "PipError" and "pip install wantsnew failed (exit status 1)" in ex.error.value
        assert "(from the appliance's wheel cache)" not in ex.stdout and "went on" not in ex.stdout
        assert "rangedep>=2" in ex.stderr, ex.stderr
