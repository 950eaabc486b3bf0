"""The REST mirror: NDJSON frames over plain HTTP, sessions, OpenAPI docs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
import pytest
from aiohttp import web

from appliance.api import mcp_http, rest
from appliance.wire.openapi import openapi_document
from tests.support import Server, start_server

TOKEN = "rest-token-123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def restsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # appliance.test: the name the docs-page test reaches it by (Host names are checked).
    srv = start_server(
        tmp_path_factory.mktemp("rest"), SANDBOX_AUTH_TOKEN=TOKEN, SANDBOX_ALLOWED_HOSTS="appliance.test"
    )
    yield srv
    srv.stop()


async def post_exec(server: Server, body: object) -> tuple[int, str, list[dict[str, Any]]]:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(server.http + "/v1/exec", json=body) as resp:
            text = await resp.text()
            ctype = resp.headers.get("Content-Type", "")
    frames = [json.loads(line) for line in text.splitlines() if line.strip()]
    return resp.status, ctype, frames


async def test_exec_streams_the_same_frames_as_ndjson(restsrv: Server) -> None:
    status, ctype, frames = await post_exec(restsrv, {"id": "h1", "code": "print('over http')\n6*7"})
    assert status == 200 and ctype.startswith("application/x-ndjson")
    assert [f["type"] for f in frames] == ["start", "stream", "result", "done"]
    assert frames[1]["text"] == "over http\n" and frames[2]["data"] == {"text/plain": "42"}
    assert all(f["id"] == "h1" for f in frames) and frames[-1]["status"] == "ok"


async def test_exec_frames_arrive_while_the_code_runs(restsrv: Server) -> None:
    import time

    arrivals = []
    async with aiohttp.ClientSession(headers=AUTH) as http:
        # 2 s apart, and read as at least 1 s apart: a reader held up by a busy machine when
        # the first line came still sees the gap.
        body = {"code": "import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')"}
        async with http.post(restsrv.http + "/v1/exec", json=body) as resp:
            async for line in resp.content:
                if line.strip():
                    arrivals.append((time.monotonic(), json.loads(line)))
    first = next(t for t, f in arrivals if f["type"] == "stream")
    assert arrivals[-1][0] - first >= 1.0


async def test_a_bad_request_is_a_400_with_a_rejected_done(restsrv: Server) -> None:
    status, _, frames = await post_exec(restsrv, {"code": 1})
    assert (
        status == 400
        and frames[0]["status"] == "rejected"
        and "'code' must be a string" in frames[0]["message"]
    )


async def test_rest_needs_the_token(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(restsrv.http + "/v1/exec", json={"code": "1"}) as resp:
            assert resp.status == 401


async def test_sessions_open_run_and_close_over_rest(restsrv: Server) -> None:
    async with aiohttp.ClientSession(headers=AUTH) as http:
        async with http.post(restsrv.http + "/v1/sessions", json={"code": "v = 'persisted'"}) as resp:
            assert resp.status == 201
            sid = (await resp.json())["session"]
        async with http.post(restsrv.http + "/v1/exec", json={"code": "v", "session": sid}) as resp:
            frames = [json.loads(x) for x in (await resp.text()).splitlines()]
        assert frames[-2]["data"]["text/plain"] == "'persisted'"
        async with http.delete(restsrv.http + f"/v1/sessions/{sid}") as resp:
            assert resp.status == 204
        async with http.delete(restsrv.http + f"/v1/sessions/{sid}") as resp:
            assert resp.status == 404


async def test_openapi_and_docs_are_served(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(restsrv.http + "/openapi.json") as resp:
            spec = await resp.json()
        async with http.get(restsrv.http + "/docs") as resp:
            page = await resp.text()
    assert (
        spec["openapi"].startswith("3.")
        and "/v1/exec" in spec["paths"]
        and "/v1/sessions/{session_id}" in spec["paths"]
    )
    assert "swagger-ui" in page and "<title>Appliance API</title>" in page


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href", "action", "srcset") and value]


async def test_the_docs_page_loads_only_its_own_packaged_assets(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(restsrv.http + "/docs") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
            page, csp = await resp.text(), resp.headers["Content-Security-Policy"]
        links = _Links()
        links.feed(page)
        assert links.urls, "the page names its assets"
        for url in links.urls:
            assert not urlsplit(url).scheme and not urlsplit(url).netloc, f"{url} leaves the server"
            async with http.get(urljoin(restsrv.http + "/docs", url)) as resp:
                body = await resp.read()
                assert resp.status == 200 and len(body) > 100, url
                if url.endswith(".js"):
                    assert resp.content_type == "application/javascript", url
                    assert resp.headers["Content-Security-Policy"] == csp
        async with http.get(restsrv.http + "/docs/init.js") as resp:
            init = await resp.text()
        async with http.get(restsrv.http + "/docs/..%2Fopenapi.json") as resp:
            assert resp.status == 404, "only the listed assets are served"
    # Nothing in our page or its start-up script names another origin ...
    assert "://" not in page and "://" not in init
    assert 'url: "openapi.json"' in init and "validatorUrl: null" in init
    # ... and whatever the bundle might try, the browser is told to load nothing from elsewhere.
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'" and directives["script-src"] == "'self'"
    for directive, sources in directives.items():
        assert "http" not in sources and "*" not in sources, (directive, sources)


async def test_every_documented_route_exists_on_the_real_server(restsrv: Server) -> None:
    spec = openapi_document()
    async with aiohttp.ClientSession(headers=AUTH) as http:
        for path, methods in spec["paths"].items():
            for method in methods:
                url = restsrv.http + path.replace("{session_id}", "0" * 32).replace(
                    "{snapshot_id}", "0" * 32
                ).replace("{run}", "0" * 16)
                async with http.request(
                    method.upper(), url, json={"code": 5}
                ) as resp:  # rejected: runs nothing
                    body = await resp.text()
                # aiohttp's own "no such route" answers, not ours:
                assert resp.status != 405 and body != "404: Not Found", (method, path, resp.status)


async def test_docs_slash_redirects_to_the_page_and_mcp_is_documented(restsrv: Server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(restsrv.http + "/docs/", allow_redirects=False) as resp:
            status, location = resp.status, resp.headers.get("Location")
        async with http.get(restsrv.http + "/docs/") as resp:
            landed, page = str(resp.url), await resp.text()
        async with http.get(restsrv.http + "/openapi.json") as resp:
            spec = await resp.json()
    assert status == 308 and location == "../docs", (status, location)
    assert landed == restsrv.http + "/docs" and "<title>Appliance API</title>" in page
    assert {"get", "post", "delete"} <= set(spec["paths"]["/mcp"])
    example = spec["paths"]["/mcp"]["post"]["requestBody"]["content"]["application/json"]["example"]
    assert example["method"] == "initialize"


async def test_try_it_out_from_the_docs_page_is_same_origin_and_runs(restsrv: Server) -> None:
    """What Swagger UI's "Try it out" sends from /docs: the browser adds the page's Origin,
    which is the server's own (the Host the request came to)."""
    own = {**AUTH, "Origin": restsrv.http}
    async with aiohttp.ClientSession(headers=own) as http:
        async with http.post(restsrv.http + "/v1/exec", json={"code": "6*7"}) as resp:
            status, frames = resp.status, [json.loads(x) for x in (await resp.text()).splitlines()]
        async with http.post(restsrv.http + "/v1/sessions", json={"code": "x = 1"}) as resp:
            opened = resp.status, await resp.json()
        async with http.delete(restsrv.http + f"/v1/sessions/{opened[1]['session']}") as resp:
            closed = resp.status
        # With a token, a name (not only an IP literal) is the server's own when it is the Host.
        named = {
            **AUTH,
            "Host": f"appliance.test:{restsrv.port}",
            "Origin": f"http://appliance.test:{restsrv.port}",
        }
        async with http.post(restsrv.http + "/v1/exec", json={"code": "1"}, headers=named) as resp:
            by_name = resp.status
        async with http.post(
            restsrv.http + "/v1/exec", json={"code": "1"}, headers={**named, "Authorization": ""}
        ) as resp:
            without_token = resp.status
    assert status == 200 and frames[-1]["status"] == "ok" and frames[-2]["data"] == {"text/plain": "42"}
    assert opened[0] == 201 and closed == 204
    assert by_name == 200 and without_token == 401


def test_every_rest_route_is_documented() -> None:
    app = web.Application()
    rest.add_routes(app, web.AppKey("appliance", object), lambda request: "owner")
    mcp_http.add_routes(app, web.AppKey("appliance", object), lambda request: "owner")
    documented = {
        (path, method.upper()) for path, ops in openapi_document()["paths"].items() for method in ops
    }
    routed = {(r.resource.canonical, r.method) for r in app.router.routes() if r.resource is not None}
    undocumented = {
        (p, m) for p, m in routed if m != "HEAD" and p not in ("/docs/{name}", "/docs/")
    } - documented
    assert not undocumented
