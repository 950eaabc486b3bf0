"""stdin frames feed input(); interrupt stops a cell that would otherwise run for a minute."""

from __future__ import annotations

import asyncio

from appliance_client.client import AsyncClient
from tests.support import Server, until_async


async def test_input_is_answered_by_a_stdin_frame_after_its_prompt(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        frames = []
        async for frame in c.stream("name = input('name? ')\nprint('hello', name)", id="q1"):
            frames.append(frame)
            if frame["type"] == "stream" and frame["text"] == "name? ":
                await c.stdin("q1", "world\n")
    text = "".join(f["text"] for f in frames if f["type"] == "stream")
    assert text == "name? hello world\n" and frames[-1]["status"] == "ok"


async def test_stdin_sent_before_the_run_starts_is_kept(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        task = asyncio.create_task(c.execute("print(input() + input())", id="early"))
        await asyncio.sleep(0)
        await c.stdin("early", "a\nb\n")
        ex = await task
    assert ex.stdout == "ab\n"


async def test_stdin_eof_gives_eoferror(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        ex = await c.execute("import sys\nprint(repr(sys.stdin.read()))\ninput()", stdin_eof=True)
    assert ex.stdout == "''\n" and ex.error is not None and ex.error["ename"] == "EOFError"


async def test_stdin_for_a_finished_run_is_rejected(server: Server) -> None:
    async with AsyncClient(server.url) as c:
        await c.execute("1", id="over")
        rejected = [f async for f in c.stream("1", id="probe")]
        await c.stdin("over", "late\n")
        late = await until_async(
            lambda: [f for f in c.unrouted if f.get("id") == "over"], 30, "the late stdin's reply"
        )
    assert rejected[-1]["status"] == "ok"
    assert late and late[-1]["status"] == "rejected" and "no running request" in late[-1]["message"]


async def test_interrupt_stops_a_sleeping_cell(server: Server) -> None:
    # The cell sleeps a minute and then prints: a `cancelled` done without "woke" is the
    # interrupt's doing, whatever the machine's speed (the suite's timeout bounds the wait).
    async with AsyncClient(server.url) as c:
        up = asyncio.Event()
        task = asyncio.create_task(
            c.execute(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(60)\nprint('woke')",
                id="zz",
                on_stdout=lambda _: up.set(),
            )
        )
        await up.wait()
        await c.interrupt("zz")
        ex = await task
    assert ex.status == "cancelled", ex
    assert ex.stdout == "sleeping\n"


async def test_interrupt_in_a_session_keeps_the_interpreter(server: Server) -> None:
    async with AsyncClient(server.url) as c, c.session() as s:
        await s.execute("state = 'alive'")
        up = asyncio.Event()
        task = asyncio.create_task(
            s.execute(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(60)\nstate = 'woke'",
                id="sz",
                on_stdout=lambda _: up.set(),
            )
        )
        await up.wait()
        await c.interrupt("sz")
        ex = await task
        after = await s.execute("state")
    assert ex.status == "cancelled", ex
    assert after.text == "'alive'"
