"""Batched test cases: a jail per case beside one jail with a per-case limit, in one run.

    python -m benchmarks.fusion_cases [--quick] [--out DIR]

One server (default settings, no token); one program and N cases (stdin in, expected output
out; one case fails on purpose). The sides alternate, each request sent with the warm pool
full and idle:

- jail_per_case: `POST /run_tests`, the appliance's batched endpoint: each case a one-shot
  run in a fresh jail (its own processes, memory limit, /tmp and workspace), at most
  SANDBOX_MAX_CONCURRENCY of them at a time, the verdict made by the server from what it saw;
- one_jail_subprocess: `POST /run_code` with a harness that runs every case as a child
  interpreter of one jail, each under its own wall-clock limit (subprocess timeout), the
  verdicts made in the jail;
- one_jail_in_process: the same harness calling the program in the jail's own interpreter,
  case after case (no per-case process at all: the cheapest form, and the least isolated).

Each side must reach the same verdicts. Writes fusion_cases.json and fusion_cases.md (quick:
fusion_cases_quick.*) into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.appliance_server import REPO, ApplianceServer, BenchError, start_appliance
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"
SIDES = ("jail_per_case", "one_jail_subprocess", "one_jail_in_process")
PROGRAM = """\
import sys

def collatz(n):
    steps = 0
    while n != 1:
        n = 3 * n + 1 if n % 2 else n // 2
        steps += 1
    return steps

print(collatz(int(sys.stdin.read())))
"""


def _collatz(n: int) -> int:
    steps = 0
    while n != 1:
        n = 3 * n + 1 if n % 2 else n // 2
        steps += 1
    return steps


def cases(n: int) -> list[dict[str, str]]:
    out = [{"stdin": str(27 + i), "expected_output": str(_collatz(27 + i))} for i in range(n)]
    out[-1]["expected_output"] = "-1"  # one wrong answer: every side must say so
    return out


HARNESS = """\
import json, subprocess, sys
program = {program}
cases = {cases}
verdicts = []
for case in cases:
    try:
        done = subprocess.run([sys.executable, "-c", program], input=case["stdin"].encode(),
                              capture_output=True, timeout={timeout})
    except subprocess.TimeoutExpired:
        verdicts.append("timeout")
        continue
    if done.returncode:
        verdicts.append("runtime_error")
    elif done.stdout.decode().rstrip("\\n") != case["expected_output"].rstrip("\\n"):
        verdicts.append("wrong_answer")
    else:
        verdicts.append("passed")
print(json.dumps(verdicts))
"""

IN_PROCESS = """\
import io, json, sys
program = compile({program}, "<program>", "exec")
cases = {cases}
verdicts = []
real_in, real_out = sys.stdin, sys.stdout
for case in cases:
    sys.stdin, sys.stdout = io.StringIO(case["stdin"]), io.StringIO()
    try:
        exec(program, {{"__name__": "__main__"}})
        out = sys.stdout.getvalue()
        verdict = "passed" if out.rstrip("\\n") == case["expected_output"].rstrip("\\n") else "wrong_answer"
    except Exception:
        verdict = "runtime_error"
    finally:
        sys.stdin, sys.stdout = real_in, real_out
    verdicts.append(verdict)
print(json.dumps(verdicts))
"""


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(  # noqa: S310 (http:// to the server this benchmark started)
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 (as above)
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def _verdicts(side: str, base: str, batch: list[dict[str, str]]) -> list[str]:
    if side == "jail_per_case":
        body = {"code": PROGRAM, "language": "python", "run_timeout": 5, "cases": batch}
        answer = _post(base, "/run_tests", body)
        for case in answer["cases"]:
            if case["verdict"] == "sandbox_error":  # counted, and said, beside the figures
                print(f"sandbox error: {case['run_result']['stderr'].strip()}", file=sys.stderr)
        return [c["verdict"] for c in answer["cases"]]
    template = HARNESS if side == "one_jail_subprocess" else IN_PROCESS
    code = template.format(program=repr(PROGRAM), cases=repr(batch), timeout=5)
    answer = _post(base, "/run_code", {"code": code, "language": "python", "run_timeout": 60})
    run = answer["run_result"]
    if answer["status"] != "Success":
        raise BenchError(f"{side}: the harness ended {answer['status']}: {run['stderr'][-400:]}")
    verdicts: list[str] = json.loads(run["stdout"].splitlines()[-1])
    return verdicts


def _wait_idle(server: ApplianceServer, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("appliance_pool_starting", 0) == 0 and m.get("appliance_active_runs", 0) == 0:
            return
        time.sleep(0.05)
    raise BenchError("the pool did not settle")


def sample(server: ApplianceServer, reps: int, n_cases: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Each side's request times (ms), and its cases that hit a sandbox error (a jail that
    did not start, say): those are counted, any other verdict than expected fails."""
    base = f"http://127.0.0.1:{server.port}"
    batch = cases(n_cases)
    expected = ["passed"] * (n_cases - 1) + ["wrong_answer"]
    out: dict[str, list[float]] = {side: [] for side in SIDES}
    errors = dict.fromkeys(SIDES, 0)
    for _ in range(reps):
        for side in SIDES:
            _wait_idle(server)
            t0 = time.perf_counter()
            verdicts = _verdicts(side, base, batch)
            took = (time.perf_counter() - t0) * 1000
            errors[side] += verdicts.count("sandbox_error")
            if any(v not in (want, "sandbox_error") for v, want in zip(verdicts, expected, strict=True)):
                raise BenchError(f"{side} gave {verdicts}, not {expected}")
            out[side].append(took)
    return out, errors


def report(
    quick: bool, out_dir: Path, n_cases: int, samples: dict[str, list[float]], errors: dict[str, int]
) -> dict[str, Any]:
    s = {k: summarize(v) for k, v in samples.items()}
    base = s["jail_per_case"].p50_ms
    doc: dict[str, Any] = {
        "quick": quick,
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "commit": _commit(),
        "cases_per_request": n_cases,
        "load_average": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "summary": {k: v.as_dict() for k, v in s.items()},
        "samples": samples,
        "sandbox_errors": errors,
        "p50_vs_jail_per_case": {k: v.p50_ms / base for k, v in s.items()},
    }
    name = "fusion_cases_quick" if quick else "fusion_cases"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
    labels = {
        "jail_per_case": "jail per case: POST /run_tests (server-side verdicts)",
        "one_jail_subprocess": "one jail, a child interpreter per case under its own timeout: POST /run_code",
        "one_jail_in_process": "one jail, every case in its one interpreter (no per-case limit): POST /run_code",
    }
    md = [
        f"# batched test cases: {n_cases} cases a request ({doc['cpus']} CPUs, commit {doc['commit']}"
        f"{', quick' if quick else ''}; load average {doc['load_average']})",
        "",
        "| side | n | p50 ms | p90 ms | per case p50 ms | p50 / jail per case | cases with a sandbox error |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {labels[k]} | {x.n} | {x.p50_ms:.1f} | {x.p90_ms:.1f} | {x.p50_ms / n_cases:.1f} "
            f"| {doc['p50_vs_jail_per_case'][k]:.2f} | {errors[k]} of {x.n * n_cases} |"
            for k, x in s.items()
        ),
        "",
        "Same verdicts on every side (one wrong answer on purpose), but for cases that hit a sandbox "
        "error (a jail that did not start), counted above. `python -m benchmarks.fusion_cases`.",
        "",
    ]
    (out_dir / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-fusion-") as tmp:
        server = start_appliance("fusion", Path(tmp), SANDBOX_PRELOAD="")
        try:
            samples, errors = sample(server, 2 if args.quick else 6, args.cases)
        finally:
            server.stop()
    report(args.quick, args.out, args.cases, samples, errors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
