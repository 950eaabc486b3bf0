"""The security audit: run the adversarial suite (tests/attacks) and write its report.

The suite's pytest plugin (`tests/attacks/conftest.py`) gathers one `AuditRow` per
attack and calls `write_report`; `python -m security.audit` (`make audit`) runs that suite
with pytest. It lives beside the suite in the checkout, not in the installed package: the
audit is of a source tree, and the package needs none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "tests" / "attacks"
DEFAULT_OUT = REPO / "security"
REPORT_DIR_ENV = "APPLIANCE_AUDIT_DIR"
CLASSES = (
    "escape",
    "exfiltration",
    "denial of service",
    "protocol abuse",
    "transport and time",
    "filesystem and IPC",
    "cross-site requests",
)


@dataclass(frozen=True)
class AuditRow:
    """One attack as tried against a real server: what should happen and what did."""

    attack: str
    cls: str
    expected: str
    observed: str
    contained: bool
    test: str


def summary(rows: Sequence[AuditRow]) -> dict[str, dict[str, int]]:
    """Attacks, contained and uncontained counts per class."""
    out: dict[str, dict[str, int]] = {}
    total = Counter(r.cls for r in rows)
    held = Counter(r.cls for r in rows if r.contained)
    for cls in sorted(total, key=lambda c: (CLASSES.index(c) if c in CLASSES else 99, c)):
        out[cls] = {"attacks": total[cls], "contained": held[cls], "uncontained": total[cls] - held[cls]}
    return out


def write_report(rows: Sequence[AuditRow], out_dir: Path, meta: dict[str, str]) -> tuple[Path, Path]:
    """Write audit-report.json and audit-report.md under out_dir; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=lambda r: CLASSES.index(r.cls) if r.cls in CLASSES else len(CLASSES))
    counts = summary(rows)
    uncontained = [r for r in rows if not r.contained]
    doc = {
        "meta": meta,
        "total": len(rows),
        "uncontained": len(uncontained),
        "per_class": counts,
        "attacks": [asdict(r) for r in rows],
    }
    json_path = out_dir / "audit-report.json"
    json_path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    lines = [
        "# Appliance security audit",
        "",
        "Every row is one attack run as real code in a real firejail jail through a real",
        "server (`tests/attacks/`); *contained* means the test asserting the attack fails",
        "or is contained passed. Regenerate with `make audit`.",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "| class | attacks | contained | uncontained |",
        "|---|---|---|---|",
        *(f"| {c} | {v['attacks']} | {v['contained']} | {v['uncontained']} |" for c, v in counts.items()),
        f"| **all** | **{len(rows)}** | **{len(rows) - len(uncontained)}** | **{len(uncontained)}** |",
        "",
        "| # | attack | class | expected | observed | contained |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {_cell(r.attack)} | {r.cls} | {_cell(r.expected)} | {_cell(r.observed)} | "
            f"{'yes' if r.contained else '**NO**'} |"
        )
    md_path = out_dir / "audit-report.md"
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


def _cell(text: str) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= 300 else flat[:297] + "..."


def default_meta() -> dict[str, str]:
    """Where and when the audit ran."""
    firejail = "unknown"
    try:
        # S607: fixed argv; the report names the firejail on PATH
        out = subprocess.run(["firejail", "--version"], capture_output=True, text=True, timeout=10).stdout  # noqa: S607
        firejail = out.splitlines()[0] if out else firejail
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "firejail": firejail,
    }


def run_audit(out_dir: Path = DEFAULT_OUT, pytest_args: Sequence[str] = ()) -> int:
    """Run the adversarial suite with pytest; the report lands in out_dir. Returns pytest's code."""
    if not SUITE.is_dir():
        print(f"audit: the attack suite is not here ({SUITE})", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env[REPORT_DIR_ENV] = str(out_dir.resolve())
    cmd = [sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", *pytest_args]
    # S603: our interpreter, our suite; the operator's pytest args
    code = subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode  # noqa: S603
    md = out_dir / "audit-report.md"
    if md.exists():
        print(f"audit report: {md} and {out_dir / 'audit-report.json'}")
    else:
        print("audit: no report was written (the suite did not run to the end)", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m security.audit", description="run the adversarial security suite and write its report"
    )
    parser.add_argument("--out", default=None, help="report directory (default: security/ in the checkout)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments, after --")
    args = parser.parse_args(argv)
    extra = [a for a in args.pytest_args if a != "--"]
    return run_audit(Path(args.out) if args.out else DEFAULT_OUT, extra)


if __name__ == "__main__":
    sys.exit(main())
