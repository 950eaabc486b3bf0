"""Command line: `appliance serve`, `appliance exec`, `appliance mcp`, `appliance bench`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from appliance.core.errors import SettingsError, StartupError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="appliance", description="Jailed Python exec over WebSocket")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the appliance server")
    # S104: a container's server must listen on its interface; serve warns when exposed without a token
    serve.add_argument("--host", default="0.0.0.0")  # noqa: S104
    serve.add_argument("--port", type=int, default=9100)
    serve.add_argument("--ready-file", help=argparse.SUPPRESS)
    # Listed for --help: both are the client's commands (appliance_client.cli), run from there.
    sub.add_parser("exec", help="run code on an appliance and stream the output (needs appliance-client)")
    sub.add_parser("mcp", help="serve run_python to a local agent over MCP stdio (needs appliance-client)")
    # Listed for --help; its arguments (--quick, --out, ...) belong to benchmarks.suite.
    sub.add_parser("bench", help="run the benchmark suite (python -m benchmarks) from a checkout")
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["bench"]:
        return _bench(raw[1:])
    if raw[:1] in (["exec"], ["mcp"]):
        return _client_command(raw)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    parser.error(f"unknown command {args.command}")
    return 2  # parser.error exits; this line is for the type checker


def _client_command(argv: list[str]) -> int:
    """`appliance exec` and `appliance mcp` are the client distribution's commands
    (appliance_client.cli): the server package never imports the client, so they run only
    where the client is installed too (`make setup` installs both)."""
    try:
        from appliance_client import cli as client_cli
    except ImportError:
        print(
            f"appliance {argv[0]}: this command is the client's: install it with `pip install ./client` "
            "(`pip install './client[mcp]'` for mcp), or run `appliance-exec` / `appliance-mcp`",
            file=sys.stderr,
        )
        return 2
    return client_cli.main(argv)


def _serve(args: argparse.Namespace) -> int:
    from appliance import settings
    from appliance.api.server import serve
    from appliance.runtime import logs
    from appliance.runtime.children import watch_children_by_pidfd

    async def main(config: settings.Settings) -> None:
        watch_children_by_pidfd()  # before the first jail starts: no thread per child process
        await serve(config, args.host, args.port, args.ready_file)

    logs.configure()
    try:
        config = settings.from_env()
        asyncio.run(main(config))
    except (SettingsError, StartupError) as exc:
        print(f"appliance: cannot start: {exc.message}", file=sys.stderr)
        return 2
    return 0


def _bench(argv: list[str]) -> int:
    """The benchmarks live beside the package in a source checkout (benchmarks/), not inside it:
    run them there, or say plainly that they need the checkout."""
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    if not (repo / "benchmarks" / "suite.py").is_file():
        print(
            "appliance bench: the benchmark suite is part of the source checkout (benchmarks/), which this "
            "installation does not have; run `python -m benchmarks` in a checkout",
            file=sys.stderr,
        )
        return 2
    # S603: our interpreter; the operator's own arguments
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=repo, check=False).returncode  # noqa: S603
