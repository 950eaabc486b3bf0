"""Inference in the sandbox, side by side in one run (real server, real jails, real llama.cpp
and whisper.cpp; generated models here, so no download):

- model load per one-shot run vs reuse in a session (the speed-up as a ratio);
- llama.cpp tokens/s inside a jail vs the same llama-cpp-python outside any jail, same
  model and threads (the jail's overhead in %);
- whisper.cpp real-time factor inside and outside.

    python -m benchmarks.inference [--quick] [--out DIR] [--models-dir DIR]

Writes inference.json, inference.md and inference.png (quick: inference_quick.*). With
`--models-dir` it uses `bench.gguf` / `bench-whisper.bin` from there (a GPU host's real
models); otherwise it writes random ones (a 4-layer llama of ~10 MB, a tensor-less
whisper of whisper-tiny's shape), whose outputs are gibberish but whose compute is real.
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

import numpy as np

from benchmarks.appliance_server import REPO, BenchError, start_appliance
from benchmarks.stats import summarize

RESULTS = REPO / "benchmarks" / "results"
LLM = "bench.gguf"
WHISPER = "bench-whisper.bin"
AUDIO_S = 5.0
EOS_BIAS = {2: -100.0}  # the generated vocab's </s>: every run generates the full count

LOAD_AND_GENERATE = """
import json, time
t0 = time.perf_counter()
from appliance.tools import load_llm
llm = load_llm({llm!r})
t1 = time.perf_counter()
out = llm.model("hello world", max_tokens={tokens}, temperature=0.0, logit_bias={bias!r})
t2 = time.perf_counter()
print(json.dumps({{"load_s": t1 - t0, "gen_s": t2 - t1, "tokens": out["usage"]["completion_tokens"],
                  "threads": llm.model.n_threads, "n_ctx": llm.shape.n_ctx}}))
"""
GENERATE = """
import json, time
t1 = time.perf_counter()
out = llm.model("hello world", max_tokens={tokens}, temperature=0.0, logit_bias={bias!r})
print(json.dumps({{"gen_s": time.perf_counter() - t1, "tokens": out["usage"]["completion_tokens"]}}))
"""
TRANSCRIBE = """
import json, time
import numpy as np
from appliance.tools import transcribe
audio = np.random.default_rng(0).uniform(-0.1, 0.1, int(16000 * {seconds})).astype(np.float32)
t0 = time.perf_counter()
transcribe(audio, model={whisper!r})
print(json.dumps({{"s": time.perf_counter() - t0}}))
"""


def meta_line(started: float) -> str:
    """When, where, the load and the commit: what a reader needs to weigh the figures."""
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
        or "?"
    )
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(started))} · {platform.platform()} · "
        f"{os.cpu_count()} CPUs · load average after {load} · {time.time() - started:.0f} s · commit {commit}"
    )


def make_models(models: Path) -> None:
    """Random models of a measurable size, through the tests' generators (the real formats)."""
    from tests.models import write_tiny_llama, write_tiny_whisper

    write_tiny_llama(models / LLM, n_embd=256, n_layer=4, n_head=4, n_ff=512, n_ctx=512)
    write_tiny_whisper(models / WHISPER)


def last_json(stdout: str) -> dict[str, Any]:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise BenchError("a run printed nothing")
    found: dict[str, Any] = json.loads(lines[-1])
    return found


class Outside:
    """The same libraries in this process, no jail: the baseline for the jail's overhead.

    Its samples are taken interleaved with the jail's, one after the other, so that a
    change in the machine's load weighs on both sides alike."""

    def __init__(self, models: Path, threads: int, n_ctx: int) -> None:
        import llama_cpp
        from pywhispercpp.model import Model

        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(models / LLM),
            n_ctx=n_ctx,
            n_gpu_layers=0,
            n_threads=threads,
            seed=0,
            verbose=False,
        )
        self.load_s = time.perf_counter() - t0
        self.whisper = Model(
            str(models / WHISPER),
            redirect_whispercpp_logs_to=None,
            n_threads=threads,
            print_progress=False,
            print_realtime=False,
        )
        self.audio = np.random.default_rng(0).uniform(-0.1, 0.1, int(16000 * AUDIO_S)).astype(np.float32)

    def generate(self, tokens: int) -> dict[str, Any]:
        t1 = time.perf_counter()
        got: Any = self.llm("hello world", max_tokens=tokens, temperature=0.0, logit_bias=EOS_BIAS)
        return {"gen_s": time.perf_counter() - t1, "tokens": got["usage"]["completion_tokens"]}

    def transcribe(self) -> dict[str, Any]:
        t1 = time.perf_counter()
        self.whisper.transcribe(self.audio)
        return {"s": time.perf_counter() - t1}


async def measure(
    url: str, models: Path, reps: int, tokens: int, quick: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(in the jail, outside): one-shot loads, then session cells and whisper, interleaved."""
    from appliance_client.client import AsyncClient

    sessions: list[str] = []

    async def checked(client: AsyncClient, code: str, **kw: Any) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        ex = await client.execute(code, timeout_ms=120000, **kw)
        wall = time.perf_counter() - t0
        if ex.status != "ok":
            raise BenchError(f"run ended {ex.status}: {ex.message} {ex.stderr[-800:]}")
        if ex.session is not None:
            sessions.append(str(ex.session))
        return last_json(ex.stdout), wall

    jail: dict[str, Any] = {"one_shot": [], "session": [], "whisper": []}
    host: dict[str, Any] = {"llm": [], "whisper": []}
    load = LOAD_AND_GENERATE.format(llm=LLM, tokens=tokens, bias=EOS_BIAS)
    async with AsyncClient(url) as client:
        for _ in range(reps):  # each run loads the model into a fresh jail
            report, wall = await checked(client, load)
            jail["one_shot"].append({**report, "wall_s": wall})
        first = jail["one_shot"][0]
        outside = Outside(models, int(first["threads"]), int(first["n_ctx"]))
        host["load_s"] = outside.load_s
        report, _ = await checked(client, load, session="new")
        jail["session_first"] = report
        sid = sessions[-1]
        for _ in range(reps):
            report, wall = await checked(client, GENERATE.format(tokens=tokens, bias=EOS_BIAS), session=sid)
            jail["session"].append({**report, "wall_s": wall})
            host["llm"].append(outside.generate(tokens))
        await client.close_session(sid)
        for _ in range(max(1, reps // (3 if quick else 2))):
            report, wall = await checked(client, TRANSCRIBE.format(seconds=AUDIO_S, whisper=WHISPER))
            jail["whisper"].append({**report, "wall_s": wall})
            host["whisper"].append(outside.transcribe())
    return jail, host


def p(values: list[float]) -> dict[str, float]:
    s = summarize([v * 1000 for v in values])
    return {"n": s.n, "p50_ms": s.p50_ms, "p90_ms": s.p90_ms}


def med(values: list[float]) -> float:
    return float(np.median(values))


def summarise(jail: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    tps_jail = [r["tokens"] / r["gen_s"] for r in jail["session"]]
    tps_host = [r["tokens"] / r["gen_s"] for r in host["llm"]]
    one_shot_wall = [r["wall_s"] for r in jail["one_shot"]]
    session_wall = [r["wall_s"] for r in jail["session"]]
    rtf_jail = [r["s"] / AUDIO_S for r in jail["whisper"]]
    rtf_host = [r["s"] / AUDIO_S for r in host["whisper"]]
    return {
        "one_shot_run": p(one_shot_wall),
        "one_shot_load": p([r["load_s"] for r in jail["one_shot"]]),
        "session_cell": p(session_wall),
        "session_speedup": med(one_shot_wall) / med(session_wall),
        "tokens_per_s": {
            "jail_p50": med(tps_jail),
            "host_p50": med(tps_host),
            "jail_overhead_pct": (med(tps_host) / med(tps_jail) - 1) * 100,
        },
        "whisper_rtf": {
            "jail_p50": med(rtf_jail),
            "host_p50": med(rtf_host),
            "jail_overhead_pct": (med(rtf_jail) / med(rtf_host) - 1) * 100,
        },
        "tokens_per_run": jail["session"][0]["tokens"],
    }


def write(out_dir: Path, stem: str, doc: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    s = doc["summary"]
    md = [
        "# Inference in the sandbox",
        "",
        doc["meta"],
        "",
        f"Models: {doc['models']}. Threads per run: {doc['threads']}. {s['tokens_per_run']} tokens per "
        f"generation; whisper on {AUDIO_S:.0f} s of audio. Figures are p50 unless named.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| one-shot run (load + generate), wall | {s['one_shot_run']['p50_ms']:.1f} ms (p90 "
        f"{s['one_shot_run']['p90_ms']:.1f}) |",
        f"| model load inside the run | {s['one_shot_load']['p50_ms']:.1f} ms |",
        f"| session cell (model kept loaded), wall | {s['session_cell']['p50_ms']:.1f} ms (p90 "
        f"{s['session_cell']['p90_ms']:.1f}) |",
        f"| **session speed-up** (one-shot / session cell) | **{s['session_speedup']:.2f}x** |",
        f"| llama.cpp tokens/s in a jail | {s['tokens_per_s']['jail_p50']:.1f} |",
        f"| llama.cpp tokens/s outside any jail | {s['tokens_per_s']['host_p50']:.1f} |",
        f"| **jail overhead, tokens/s** | **{s['tokens_per_s']['jail_overhead_pct']:+.1f} %** |",
        f"| whisper real-time factor in a jail | {s['whisper_rtf']['jail_p50']:.3f} |",
        f"| whisper real-time factor outside | {s['whisper_rtf']['host_p50']:.3f} |",
        f"| **jail overhead, whisper** | **{s['whisper_rtf']['jail_overhead_pct']:+.1f} %** |",
        "",
    ]
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(doc, indent=2) + "\n")
    paths[1].write_text("\n".join(md))
    from benchmarks.gpu_contention import pyplot

    plt = pyplot()
    if plt is None:
        return paths[:2]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].bar(
        ["one-shot run", "session cell"],
        [s["one_shot_run"]["p50_ms"], s["session_cell"]["p50_ms"]],
        color=["#999", "#2a7"],
    )
    axes[0].set_ylabel("ms (p50)")
    axes[0].set_title(f"load once: {s['session_speedup']:.1f}x")
    axes[1].bar(
        ["jail", "no jail"],
        [s["tokens_per_s"]["jail_p50"], s["tokens_per_s"]["host_p50"]],
        color=["#2a7", "#999"],
    )
    axes[1].set_title("llama.cpp tokens/s")
    axes[2].bar(
        ["jail", "no jail"],
        [s["whisper_rtf"]["jail_p50"], s["whisper_rtf"]["host_p50"]],
        color=["#2a7", "#999"],
    )
    axes[2].set_title("whisper real-time factor")
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.inference", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="few samples (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--models-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    reps, tokens = (3, 16) if args.quick else (10, 64)
    work = Path(tempfile.mkdtemp(prefix="appliance-inference-"))
    os.chmod(work, 0o755)
    models = args.models_dir
    if models is None:
        models = work / "models"
        models.mkdir()
        make_models(models)
        os.chmod(models, 0o755)
    started = time.time()
    server = start_appliance(
        "inference",
        work / "srv",
        SANDBOX_MODELS_DIR=str(models),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_PRELOAD="numpy,llama_cpp,pywhispercpp.model,appliance.tools",
        SANDBOX_PRELOAD_PROFILES="tools=numpy,llama_cpp,pywhispercpp.model,appliance.tools",
        SANDBOX_MAX_EXEC_MS="120000",
        SANDBOX_MEMORY_MB="2048",
    )
    try:
        jail, host = asyncio.run(measure(server.url, models, reps, tokens, args.quick))
    finally:
        server.stop()
    first = jail["one_shot"][0]
    doc = {
        "meta": meta_line(started),
        "models": "generated" if args.models_dir is None else str(models),
        "threads": first["threads"],
        "reps": reps,
        "summary": summarise(jail, host),
        "jail": jail,
        "host": host,
    }
    paths = write(args.out, "inference_quick" if args.quick else "inference", doc)
    shutil.rmtree(work, ignore_errors=True)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
