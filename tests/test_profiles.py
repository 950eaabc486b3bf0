"""Import-aware warm pools: a run gets the preload profile its code's imports fit."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from collections.abc import Iterator
from typing import Unpack, cast

import pytest

from appliance.core.errors import SettingsError
from appliance.sandbox.pool import JailPool, ProfilePools
from appliance.sandbox.profiles import SCAN_CHARS, Profile, choose, imports_of
from appliance.settings import from_env
from appliance_client.client import AsyncClient, Execution, RequestOptions
from tests.support import Server, scaled, start_server

BARE = Profile("bare", ())
SCIENCE = Profile("science", ("numpy", "pandas", "matplotlib"))
TOOLS = Profile(
    "full", ("numpy", "pandas", "matplotlib", "llama_cpp", "pywhispercpp.model", "appliance.tools")
)
PROFILES = (BARE, SCIENCE, TOOLS)


class TestTheScan:
    def test_it_finds_imports_anywhere_in_the_code_by_their_top_level_package(self) -> None:
        code = (
            "import os, json as j\nfrom matplotlib import pyplot\n"
            "def f():\n    import pandas as pd\n    from numpy.linalg import norm\n"
            "if False:\n    import llama_cpp\nfrom . import sibling\n"
        )
        assert imports_of(code) == frozenset({"os", "json", "matplotlib", "pandas", "numpy", "llama_cpp"})

    def test_the_scan_is_a_pattern_so_code_that_does_not_parse_is_scanned_too(self) -> None:
        assert imports_of("import pandas\nthis is not python(") == frozenset({"pandas"})
        code = "x = 1; import numpy\ntry: from pandas.io import json\nexcept: pass\nimport (a.b, c as d)\n"
        assert imports_of(code) == frozenset({"numpy", "pandas", "a", "c"})

    def test_code_longer_than_the_scan_takes_is_not_scanned_and_gets_the_largest_profile(self) -> None:
        # The scan runs on the event loop: its work must not grow with the code.
        assert imports_of("import json\n" + "x = 1\n" * (SCAN_CHARS // 6)) is None
        assert choose(PROFILES, None) is TOOLS
        assert imports_of("import json\n" + "x = 1\n" * ((SCAN_CHARS - 12) // 6)) == frozenset({"json"})

    def test_code_without_the_word_import_imports_nothing_and_look_alike_keywords_do_not_parse(self) -> None:
        # The scan skips the parse when "import" is not in the code: that is only right
        # while no import statement can be spelt without it.
        for code in ("print(2+2)", "x = __builtins__\nprint(x)", ""):
            assert imports_of(code) == frozenset()
        for code in (
            "\uff49\uff4d\uff50\uff4f\uff52\uff54 os",
            "from os \uff49\uff4d\uff50\uff4f\uff52\uff54 path",
        ):
            with pytest.raises(SyntaxError):
                ast.parse(code)

    def test_stdlib_code_gets_a_bare_jail_and_pandas_code_the_smallest_with_pandas(self) -> None:
        assert choose(PROFILES, imports_of("import json\nprint(json.dumps(1))")) is BARE
        assert choose(PROFILES, imports_of("import pandas as pd")) is SCIENCE
        assert choose(PROFILES, imports_of("from appliance.tools import load_llm\nimport numpy")) is TOOLS
        assert choose(PROFILES, imports_of("import importlib\nimportlib.import_module('pandas')")) is BARE

    def test_without_a_profile_that_has_every_import_the_one_with_most_wins(self) -> None:
        a, b = Profile("a", ("numpy",)), Profile("b", ("pandas", "scipy"))
        assert choose((a, b), frozenset({"numpy", "pandas", "scipy"})) is b
        assert choose((a, b), frozenset({"numpy", "pandas"})) is b  # a tie goes to the larger

    def test_profiles_are_configurable_and_bad_ones_name_the_variable(self) -> None:
        assert from_env({"SANDBOX_PRELOAD_PROFILES": "bare=;np=numpy"}).preload_profiles == (
            ("bare", ()),
            ("np", ("numpy",)),
        )
        assert from_env({}).preload_profiles == (("bare", ()), ("full", ("numpy", "pandas", "matplotlib")))
        assert from_env({"SANDBOX_PRELOAD": ""}).preload_profiles == (("bare", ()),)
        for bad in ("np", "Bad=numpy", "a=;a=os", "np=not-a-module"):
            with pytest.raises(SettingsError, match="SANDBOX_PRELOAD_PROFILES"):
                from_env({"SANDBOX_PRELOAD_PROFILES": bad})


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("profiles"), SANDBOX_POOL_SIZE="1", SANDBOX_PRELOAD_PROFILES="bare=;np=numpy"
    )
    yield srv
    srv.stop()


async def run(server: Server, code: str, **fields: Unpack[RequestOptions]) -> Execution:
    async with AsyncClient(server.url) as client:
        return await client.execute(code, **fields)


def pools(server: Server) -> dict[str, dict[str, int]]:
    status, body = server.get("/readyz")
    assert status == 200, body
    found: dict[str, dict[str, int]] = json.loads(body)["pools"]
    return found


async def until_full(server: Server) -> dict[str, dict[str, int]]:
    deadline = time.monotonic() + scaled(60)
    while True:
        now = pools(server)
        if all(p["ready"] >= 1 and p["starting"] == 0 for p in now.values()):
            return now
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.1)


def profile_runs(server: Server) -> dict[str, float]:
    _, body = server.get("/metrics")
    found = {}
    for line in body.splitlines():
        if line.startswith("appliance_profile_runs_total{"):
            found[line.split('profile="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


CHECK = "import sys\nprint('numpy' in sys.modules)"


async def test_a_cell_importing_numpy_gets_a_numpy_warm_jail_and_pays_no_import(profiled: Server) -> None:
    await until_full(profiled)
    before = profile_runs(profiled)
    ex = await run(profiled, "import numpy\nprint(numpy.arange(3).sum())")
    assert ex.status == "ok" and ex.stdout == "3\n", ex
    done = ex.frames[-1]
    assert done["import_ms"] is not None and done["import_ms"] < 20, done
    assert profile_runs(profiled).get("np", 0) == before.get("np", 0) + 1


async def test_a_stdlib_cell_gets_a_bare_jail(profiled: Server) -> None:
    await until_full(profiled)
    before = profile_runs(profiled)
    ex = await run(profiled, CHECK)
    assert ex.status == "ok" and ex.stdout == "False\n", ex
    assert profile_runs(profiled).get("bare", 0) == before.get("bare", 0) + 1


async def test_a_dynamic_import_the_scan_cannot_see_still_works(profiled: Server) -> None:
    await until_full(profiled)
    ex = await run(profiled, "import importlib\nnp = importlib.import_module('numpy')\nprint(np.add(2, 2))")
    assert ex.status == "ok" and ex.stdout == "4\n", ex


async def test_a_sessions_later_cell_can_import_what_its_first_did_not(profiled: Server) -> None:
    await until_full(profiled)
    async with AsyncClient(profiled.url) as client:
        first = await client.execute("x = 20", session="new")
        assert first.status == "ok", first
        later = await client.execute("import numpy\nprint(numpy.int64(x) + 1)", session=first.session)
        await client.close_session(str(first.session))
    assert later.status == "ok" and later.stdout == "21\n", later
    assert later.frames[-1]["import_ms"] > 0, "the bare session jail had to load numpy itself"


async def test_each_profiles_pool_refills_on_its_own(profiled: Server) -> None:
    full = await until_full(profiled)
    ex = await run(profiled, "import numpy")
    assert ex.status == "ok", ex
    seen_bare = []
    deadline = time.monotonic() + scaled(60)
    while True:
        now = pools(profiled)
        seen_bare.append(now["bare"]["ready"])
        # Against the target, not the first reading: a pool may briefly hold more than its
        # target (a refill that raced the draw), and the first reading may be that moment.
        if now["np"]["ready"] >= now["np"]["target"] and now["np"]["starting"] == 0:
            break
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.05)
    assert min(seen_bare) >= min(full["bare"]["ready"], full["bare"]["target"]), (
        "the bare pool was drawn on for a numpy run"
    )


@pytest.mark.parametrize(
    "code",
    [
        "print(2+2)",
        "import numpy\nnumpy.zeros(3)",
        "import json",
        "x = 1  # no import",
        "#" * (SCAN_CHARS + 1),
    ],
)
def test_the_pools_give_a_run_the_profile_choose_names_and_count_it(code: str) -> None:
    profiles = (Profile("bare", ()), Profile("numeric", ("numpy",)), Profile("data", ("numpy", "pandas")))
    pools = ProfilePools(dict.fromkeys(profiles, cast(JailPool, None)))
    imports = imports_of(code)
    assert pools.profile_for(code) == choose(profiles, imports)
    assert pools.runs == {choose(profiles, imports).name: 1}
    assert pools.imported == ({"numpy": 1} if imports and "numpy" in imports else {})
