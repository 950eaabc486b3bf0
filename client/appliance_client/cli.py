"""The client's commands: `appliance-exec` (run code on an appliance and stream its output) and
`appliance-mcp` (the stdio MCP bridge). The server's `appliance exec` and `appliance mcp` are the
same commands, run from here when this package is installed (appliance.cli)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path


def exec_url(url: str) -> str:
    """The WebSocket endpoint of an appliance URL: `ws://host:9100` means `ws://host:9100/exec`."""
    scheme, sep, rest = url.partition("://")
    if sep and "/" not in rest:
        return f"{scheme}://{rest}/exec"
    return url


def parser(prog: str = "appliance") -> argparse.ArgumentParser:
    """`exec` and `mcp`, with their arguments."""
    top = argparse.ArgumentParser(prog=prog, description="Run code on an appliance; serve it to agents")
    sub = top.add_subparsers(dest="command", required=True)
    exec_arguments(
        sub.add_parser("exec", help="run code (or a .py file) on an appliance and stream the output")
    )
    mcp_arguments(sub.add_parser("mcp", help="serve run_python to a local agent client over MCP (stdio)"))
    return top


def exec_arguments(ex: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ex.add_argument("code", help="Python source, or a path to a .py file, or - for stdin")
    ex.add_argument("--url", default=os.environ.get("APPLIANCE_URL", "ws://127.0.0.1:9100/exec"))
    ex.add_argument("--token", default=os.environ.get("SANDBOX_AUTH_TOKEN"))
    ex.add_argument("--timeout-ms", type=int)
    ex.add_argument("--json", action="store_true", help="print raw frames as JSON lines")
    return ex


def mcp_arguments(mcp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    mcp.add_argument(
        "--url",
        default=os.environ.get("APPLIANCE_URL", "ws://127.0.0.1:9100"),
        help="the appliance to run code on (default ws://127.0.0.1:9100; env APPLIANCE_URL)",
    )
    mcp.add_argument(
        "--token",
        default=os.environ.get("SANDBOX_AUTH_TOKEN"),
        help="bearer token (default: env SANDBOX_AUTH_TOKEN)",
    )
    mcp.add_argument("--max-chars", type=int, default=8000, help="text budget of one tool result")
    mcp.add_argument(
        "--reconnect-s",
        type=float,
        default=10.0,
        help="how long one call waits for an unreachable appliance before saying so (default 10)",
    )
    return mcp


def main(argv: list[str] | None = None, prog: str = "appliance") -> int:
    """`exec ...` or `mcp ...`."""
    args = parser(prog).parse_args(argv)
    if args.command == "mcp":
        return _mcp(args)
    return asyncio.run(_exec(args))


def mcp_main(argv: list[str] | None = None) -> int:
    """`appliance-mcp [--url URL] [--token T] ...`: the stdio MCP bridge."""
    top = argparse.ArgumentParser(
        prog="appliance-mcp", description="serve run_python to a local agent over MCP"
    )
    return _mcp(mcp_arguments(top).parse_args(argv))


def exec_main(argv: list[str] | None = None) -> int:
    """`appliance-exec CODE [--url URL] ...`: run code and stream its output."""
    top = argparse.ArgumentParser(prog="appliance-exec", description="run code on an appliance")
    return asyncio.run(_exec(exec_arguments(top).parse_args(argv)))


def _mcp(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("mcp") is None:  # the bridge's extra, not the client's own need
        print(
            "appliance mcp: the bridge needs the MCP SDK: pip install 'appliance-client[mcp]'",
            file=sys.stderr,
        )
        return 2
    from appliance_client.mcp_bridge import AuthenticationError, serve_stdio

    # stdout carries the protocol: every log line goes to stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    if args.max_chars < 200:
        print("appliance mcp: --max-chars must be at least 200", file=sys.stderr)
        return 2
    if not args.reconnect_s >= 0:
        print("appliance mcp: --reconnect-s must be 0 or more", file=sys.stderr)
        return 2
    # An appliance that is not up yet is no reason to exit: the bridge serves and retries on
    # each call. A refused token is: no retry fixes it.
    try:
        asyncio.run(serve_stdio(exec_url(args.url), args.token, args.max_chars, args.reconnect_s))
    except AuthenticationError as exc:
        print(f"appliance mcp: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _read_code(arg: str) -> str:
    if arg == "-":
        return sys.stdin.read()
    path = Path(arg)
    if arg.endswith(".py") and path.is_file():
        return path.read_text()
    return arg


async def _exec(args: argparse.Namespace) -> int:
    from appliance_client.client import AsyncClient

    code = _read_code(args.code)
    status, exit_code = "internal", None
    async with AsyncClient(args.url, args.token) as client:
        async for frame in client.stream(code, timeout_ms=args.timeout_ms):
            if args.json:
                print(json.dumps(frame), flush=True)
            else:
                _render(frame)
            if frame.get("type") == "done":
                status, exit_code = frame.get("status", "internal"), frame.get("exit_code")
    if status == "ok":
        return 0
    return exit_code if isinstance(exit_code, int) and exit_code > 0 else 1


def _render(frame: dict[str, object]) -> None:
    kind = frame.get("type")
    if kind == "stream":
        out = sys.stderr if frame.get("name") == "stderr" else sys.stdout
        out.write(str(frame.get("text", "")))
        out.flush()
    elif kind == "result":
        data = frame.get("data")
        if isinstance(data, dict):
            print(data.get("text/plain", ""), flush=True)
    elif kind == "display":
        data = frame.get("data")
        kinds = ", ".join(sorted(data)) if isinstance(data, dict) else "?"
        print(f"[display: {kinds}]", flush=True)
    elif kind == "error":
        tb = frame.get("traceback")
        if isinstance(tb, list):
            sys.stderr.write("\n".join(str(line) for line in tb) + "\n")
    elif kind == "file":
        print(f"[file: outputs/{frame.get('path')} ({frame.get('size')} bytes)]", flush=True)
    elif kind == "done" and frame.get("status") != "ok":
        print(f"[{frame.get('status')}] {frame.get('message') or ''}".rstrip(), file=sys.stderr, flush=True)
