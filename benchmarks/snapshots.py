"""Session snapshots: the time and size of a snapshot and of a restore (a fork), in one run.

    python -m benchmarks.snapshots [--quick] [--out DIR]

A real server (SANDBOX_SNAPSHOT_DIR set) holds one session with a ~100 MB DataFrame (pandas
where the jail's Python has it, else a numpy array, else bytes) and 1,000 small files. Then,
interleaved so the machine's load falls on each alike:

- snapshot: `POST /v1/sessions/{id}/snapshot` of that session, to its answer (the jail pickles
  and tars, the server copies the archive into the store);
- restore: `POST /v1/sessions` with `from_snapshot` and a first cell that imports the object's
  library (`import pandas`: a warm jail of the profile that preloads it), to its answer (the
  server copies the archive into that jail, the jail unpacks and unpickles, the cell runs);
- open: `POST /v1/sessions` with the same cell and no snapshot: what any new session costs,
  the baseline the restore's own part is measured against.

Each request is sent with the pools full and idle (no refill competes with it).

The goal (issue 34): restore within 1 s, as E2B's resume. The report says met or missed.
Writes snapshots.json and snapshots.md (quick: snapshots_quick.*, a 10 MB object and 100
files) into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.appliance_server import REPO, ApplianceServer, BenchError, start_appliance, wait_pool_idle
from benchmarks.stats import Summary, summarize

RESULTS = REPO / "benchmarks" / "results"
GOAL_RESTORE_S = 1.0

STATE = """
import os
try:
    import pandas as pd, numpy as np
    rows = {mb} * (1 << 20) // 64
    big = pd.DataFrame(np.random.default_rng(1).random((rows, 8)), columns=list("abcdefgh"))
    kind = "pandas.DataFrame"
    size = int(big.memory_usage(index=True, deep=True).sum())
except ImportError:
    try:
        import numpy as np
        big = np.random.default_rng(1).random({mb} * (1 << 20) // 8)
        kind, size = "numpy.ndarray", big.nbytes
    except ImportError:
        big = os.urandom({mb} << 20)
        kind, size = "bytes", len(big)
os.makedirs("small", exist_ok=True)
for i in range({files}):
    with open(f"small/f{{i:04d}}.txt", "w") as fh:
        fh.write(f"file {{i}}\\n" * 8)
print(kind, size)
"""


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    )
    return out.stdout.strip() or "unknown"


def _call(server: ApplianceServer, method: str, path: str, body: object) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    status, text = server.request(method, path, None, body, timeout=600)
    took = time.perf_counter() - t0
    if status not in (200, 201):
        raise BenchError(f"{method} {path} answered {status}: {text[:500]}")
    return took * 1000, json.loads(text)


def _close(server: ApplianceServer, session: str) -> None:
    server.request("DELETE", f"/v1/sessions/{session}", None, None, timeout=60)


def measure(server: ApplianceServer, mb: int, files: int, reps: int) -> dict[str, Any]:
    _, opened = _call(server, "POST", "/v1/sessions", {"code": STATE.format(mb=mb, files=files)})
    done = opened["frames"][-1]
    if done["status"] != "ok":
        raise BenchError(f"the session's state could not be made: {done}")
    out = "".join(f["text"] for f in opened["frames"] if f["type"] == "stream")
    kind, size = out.split()[:2]
    session = opened["session"]
    # The fork's first cell names what it works with, as a real one does: a warm jail of the
    # profile that has it preloaded (SANDBOX_PRELOAD), for the restore and the baseline alike.
    first = {"pandas.DataFrame": "import pandas", "numpy.ndarray": "import numpy"}.get(kind, "")
    times: dict[str, list[float]] = {"snapshot": [], "restore": [], "open": []}
    sizes: list[int] = []
    for _ in range(reps):
        asyncio.run(wait_pool_idle(server, 1, timeout_s=300))
        ms, taken = _call(server, "POST", f"/v1/sessions/{session}/snapshot", {})
        times["snapshot"].append(ms)
        sizes.append(int(taken["bytes"]))
        for key, body in (
            ("restore", {"code": first, "from_snapshot": taken["snapshot"]}),
            ("open", {"code": first}),
        ):
            asyncio.run(wait_pool_idle(server, 1, timeout_s=300))
            ms, fork = _call(server, "POST", "/v1/sessions", body)
            if fork["frames"][-1]["status"] != "ok":
                raise BenchError(f"{key} failed: {fork['frames'][-1]}")
            times[key].append(ms)
            _close(server, fork["session"])
        server.request("DELETE", f"/v1/snapshots/{taken['snapshot']}", None, None, timeout=60)
    # The fork really holds the state: one more, checked.
    _, taken = _call(server, "POST", f"/v1/sessions/{session}/snapshot", {})
    _, fork = _call(
        server,
        "POST",
        "/v1/sessions",
        {"code": "print(type(big).__name__, len(os.listdir('small')))", "from_snapshot": taken["snapshot"]},
    )
    check = "".join(f["text"] for f in fork["frames"] if f["type"] == "stream").split()
    if check != [kind.rsplit(".", 1)[-1], str(files)]:
        raise BenchError(f"the fork does not hold the state: {check}")
    _close(server, session)
    return {"kind": kind, "object_bytes": int(size), "files": files, "times": times, "archive_bytes": sizes}


def report(doc: dict[str, Any], s: dict[str, Summary]) -> str:
    rows = [
        ("snapshot (POST /v1/sessions/{id}/snapshot)", "snapshot"),
        ("restore (POST /v1/sessions, from_snapshot)", "restore"),
        ("open a new session (the same, no snapshot)", "open"),
    ]
    lines = [
        f"# session snapshots ({doc['cpus']} CPUs, commit {doc['commit']}; load average {doc['load']})",
        "",
        f"A session holding a {doc['kind']} of {doc['object_bytes'] / 1e6:.1f} MB and {doc['files']} small "
        f"files; archive {doc['archive_mb']:.1f} MB.",
        "",
        "| what | n | p50 ms | p90 ms |",
        "| --- | --- | --- | --- |",
    ]
    for label, key in rows:
        lines.append(f"| {label} | {s[key].n} | {s[key].p50_ms:.1f} | {s[key].p90_ms:.1f} |")
    verdict = "met" if doc["goal_met"] else "missed"
    lines += [
        "",
        f"Restore p50 {s['restore'].p50_ms:.0f} ms, {doc['restore_over_open_p50']:.1f}x a new session's "
        f"{s['open'].p50_ms:.0f} ms; goal restore <= {GOAL_RESTORE_S:.0f} s (p50): **{verdict}**.",
        "",
        f"`python -m benchmarks.snapshots{' --quick' if doc['quick'] else ''}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 10 MB object, 100 files, 2 repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    mb, files, reps = (10, 100, 2) if args.quick else (100, 1000, 7)
    work = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    tmp_root = Path(tempfile.mkdtemp(prefix="bench-snapshots-root-", dir="/tmp"))
    tmp_root.chmod(0o755)
    server = start_appliance(
        "snapshots",
        work,
        SANDBOX_TMP_ROOT=str(tmp_root),
        SANDBOX_SNAPSHOT_DIR=str(work / "snapshots"),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MEMORY_MB="2048",
        SANDBOX_MAX_DISK_MB="1024",
        SANDBOX_MAX_FILE_MB="1024",  # the jail writes its archive as one file
        SANDBOX_MAX_EXEC_MS="120000",
    )
    try:
        found = measure(server, mb, files, reps)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp_root, ignore_errors=True)
    summary = {key: summarize(values) for key, values in found["times"].items()}
    doc = {
        "quick": args.quick,
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "kind": found["kind"],
        "object_bytes": found["object_bytes"],
        "files": found["files"],
        "archive_mb": max(found["archive_bytes"]) / 1e6,
        "raw": found["times"],
        "summary": {k: v.__dict__ for k, v in summary.items()},
        "restore_over_open_p50": summary["restore"].p50_ms / summary["open"].p50_ms,
        "goal_restore_s": GOAL_RESTORE_S,
        "goal_met": summary["restore"].p50_ms <= GOAL_RESTORE_S * 1000,
    }
    name = "snapshots_quick" if args.quick else "snapshots"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(report(doc, summary))
    print(report(doc, summary))


if __name__ == "__main__":
    main()
