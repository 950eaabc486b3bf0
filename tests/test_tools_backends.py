"""The model tools' bindings, in one process: what each can do, and whether each runs on its own ggml."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from appliance.inside.tools import backends
from appliance.inside.tools.shaping import choose, estimate_mb, place_whisper, read_gguf, shape_llama
from tests.models import write_tiny_llama, write_tiny_whisper
from tests.support import REPO

BOTH = textwrap.dedent("""\
    import json, sys
    first, second = sys.argv[1].split(",")
    __import__(first); __import__(second)
    import numpy as np
    import llama_cpp
    from pywhispercpp.model import Model
    from appliance.inside.tools import backends
    llm = llama_cpp.Llama(model_path=sys.argv[2], n_ctx=64, n_threads=1, verbose=False)
    text = llm("hello world", max_tokens=4)["choices"][0]["text"]
    whisper = Model(sys.argv[3], redirect_whispercpp_logs_to=None, print_progress=False, n_threads=1)
    segments = whisper.transcribe(np.zeros(16000, dtype=np.float32))
    print(json.dumps({"text": isinstance(text, str), "segments": isinstance(segments, list),
                      "probe": backends.probe()}))
    """)


@pytest.mark.slow  # loads llama.cpp and whisper.cpp for real: not in the fast tier
@pytest.mark.parametrize("order", ["llama_cpp,pywhispercpp.model", "pywhispercpp.model,llama_cpp"])
def test_llama_and_whisper_load_and_run_in_one_process_each_on_its_own_ggml(
    tmp_path: Path, order: str
) -> None:
    llama = write_tiny_llama(tmp_path / "tiny.gguf")
    whisper = write_tiny_whisper(tmp_path / "tiny-whisper.bin")
    proc = subprocess.run(
        [sys.executable, "-c", BOTH, order, str(llama), str(whisper)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["text"] is True and out["segments"] is True
    probe = out["probe"]
    assert probe["llama_cpp"]["available"] and probe["whisper"]["available"], probe
    assert probe["ggml_conflicts"] == [], probe
    assert "CPU" in probe["whisper"]["backends"]
    # The backends compiled into llama's ggml, read as whisper's are (the CUDA image's smoke
    # step asserts CUDA in both, where no device is there for llama_supports_gpu_offload()).
    assert "CPU" in probe["llama_cpp"]["backends"] and "CUDA" not in probe["llama_cpp"]["backends"]
    # This venv's builds are CPU builds, and the probe says so rather than guessing from the import.
    assert probe["llama_cpp"]["gpu_offload"] is False and probe["whisper"]["gpu_offload"] is False


def test_a_ggml_soname_taken_by_another_build_is_reported(tmp_path: Path) -> None:
    """Two libraries under one SONAME, as llama-cpp-python's and a source-built pywhispercpp's ggml:
    the real dynamic loader gives the second binding the first one's, and the check sees it."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed (apt-get install gcc)")
    for side in ("llama", "whisper"):
        (tmp_path / side).mkdir()
        src = tmp_path / side / "ggml.c"
        src.write_text(f'const char *ggml_build(void) {{ return "{side}"; }}\n')
        subprocess.run(
            [
                "gcc",
                "-shared",
                "-fPIC",
                "-Wl,-soname,libggml-base.so.0",
                "-o",
                str(tmp_path / side / "libggml-base.so.0"),
                str(src),
            ],
            check=True,
        )
    native = tmp_path / "whisper" / "_binding.so"
    (tmp_path / "whisper" / "binding.c").write_text(
        "const char *ggml_build(void);\nconst char *which(void) { return ggml_build(); }\n"
    )
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-o",
            str(native),
            str(tmp_path / "whisper" / "binding.c"),
            "-L",
            str(tmp_path / "whisper"),
            "-l:libggml-base.so.0",
            "-Wl,-rpath,$ORIGIN",
        ],
        check=True,
    )
    code = textwrap.dedent(f"""\
        import ctypes, json
        from appliance.inside.tools import backends
        ctypes.CDLL({str(tmp_path / "llama" / "libggml-base.so.0")!r}, mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL({str(native)!r}); lib.which.restype = ctypes.c_char_p
        expected = backends.expected_libraries({str(native)!r})
        print(json.dumps({{"runs_on": lib.which().decode(), "expected": expected,
                          "conflicts": backends.ggml_conflicts(backends.mapped_libraries(), {{"whisper": expected}})}}))
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["runs_on"] == "llama", "the loader reused the first library under that SONAME"
    assert out["expected"] == [str(tmp_path / "whisper" / "libggml-base.so.0")]
    assert len(out["conflicts"]) == 1 and "whisper ships libggml-base.so.0" in out["conflicts"][0]
    assert str(tmp_path / "llama" / "libggml-base.so.0") in out["conflicts"][0]


def test_wheel_repaired_names_never_collide_with_plain_ones() -> None:
    assert backends.soname_key("libggml-base.so.0.25.3") == "libggml-base.so"
    assert backends.soname_key("libggml-base-319ad4fb.so.0.13.1") == "libggml-base-319ad4fb.so"
    assert backends.soname_key("libstdc++.so.6") is None
    mapped = ["/a/llama_cpp/lib/libggml-base.so.0", "/a/pywhispercpp.libs/libggml-base-319ad4fb.so.0.13.1"]
    assert (
        backends.ggml_conflicts(
            mapped,
            {
                "whisper": ["/a/pywhispercpp.libs/libggml-base-319ad4fb.so.0.13.1"],
                "llama_cpp": ["/a/llama_cpp/lib/libggml-base.so.0"],
            },
        )
        == []
    )


@pytest.mark.parametrize(
    ("info", "backends_", "offload"),
    [
        ("WHISPER : COREML = 0 | OPENVINO = 0 | CPU : SSE3 = 1 | AVX2 = 1 | OPENMP = 1 | ", ["CPU"], False),
        (
            "WHISPER : COREML = 0 | OPENVINO = 0 | CUDA : ARCHS = 900 | USE_GRAPHS = 1 | CPU : AVX2 = 1 | ",
            ["CUDA", "CPU"],
            True,
        ),
        (  # llama_print_system_info(): no WHISPER section, the same backend sections
            "CUDA : ARCHS = 750,800,860,890,900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
            "CPU : SSE3 = 1 | AVX2 = 1 | LLAMAFILE = 1 | REPACK = 1 | ",
            ["CUDA", "CPU"],
            True,
        ),
        ("", [], False),
    ],
)
def test_whispers_ggml_backends_are_read_from_its_system_info(
    info: str, backends_: list[str], offload: bool
) -> None:
    names = backends.ggml_backends(info)
    assert names == backends_
    assert any(n in backends.GPU_BACKENDS for n in names) is offload


def test_all_layers_minus_one_is_shaped_to_what_fits(tmp_path: Path) -> None:
    info = read_gguf(str(write_tiny_llama(tmp_path / "m.gguf", n_layer=8, n_embd=256, n_ff=1024)))
    budget = estimate_mb(info, 3, 256) + 1
    fits = choose(info, budget)
    assert fits.n_gpu_layers == 3, fits
    for minus in (-1, -5):
        assert shape_llama(info, budget, None, minus) == fits  # "all" is every layer that fits, not -1
    assert shape_llama(info, None, None, -1).n_gpu_layers == 0  # no GPU granted: none
    assert shape_llama(info, 100_000, None, -1).n_gpu_layers == info.n_layer + 1  # all, output layer too
    assert shape_llama(info, 100_000, None, 2).n_gpu_layers == 2
    assert shape_llama(info, budget, None, 10_000) == fits


def test_whisper_runs_on_the_gpu_only_when_granted_capable_and_within_budget() -> None:
    mib = 1 << 20
    assert place_whisper(148 * mib, 2048, True, 4).use_gpu is True
    assert place_whisper(148 * mib, 2048, True, 4).n_threads == 4
    for budget, capable, wanted, reason in [
        (None, True, None, "no GPU granted"),
        (2048, False, None, "no GPU backend"),
        (600, True, None, "the budget is 600"),
        (2048, True, False, "use_gpu=False"),
    ]:
        placed = place_whisper(148 * mib, budget, capable, 2, wanted)
        assert placed.use_gpu is False and reason in placed.reason and placed.n_threads == 2
