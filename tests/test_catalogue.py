"""The model catalogue: GET /v1/models, appliance.tools.models() in a jail and Client.models()
give the same list, read from the files' headers (generated models, real formats)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from appliance.inside.tools import catalogue
from appliance_client.client import AsyncClient, Client
from tests.models import write_corrupt_model, write_tiny_llama, write_tiny_whisper
from tests.support import Server, reachable_tmp_root, start_server

TOKEN = "catalogue-token-0123456789"


def fill(models: Path, outside: Path) -> None:
    write_tiny_llama(models / "tiny.gguf")
    (models / "sub").mkdir()
    write_tiny_llama(models / "sub" / "wide.gguf", n_embd=128, n_layer=3)
    write_tiny_whisper(models / "ggml-tiny.bin")
    write_corrupt_model(models / "broken.gguf")
    (models / "README.txt").write_text("not a model")
    write_tiny_llama(outside / "secret.gguf")
    (models / "escape.gguf").symlink_to(outside / "secret.gguf")  # leads out: not listed
    (models / "alias.gguf").symlink_to(models / "tiny.gguf")  # stays inside: listed


def elements(path: Path) -> int:
    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def test_the_catalogue_reads_kind_size_quantisation_and_parameters_from_the_headers(tmp_path: Path) -> None:
    models, outside = tmp_path / "models", tmp_path / "outside"
    models.mkdir()
    outside.mkdir()
    fill(models, outside)
    found = {m.name: m for m in catalogue.catalogue(str(models))}
    assert sorted(found) == ["alias.gguf", "broken.gguf", "ggml-tiny.bin", "sub/wide.gguf", "tiny.gguf"]
    tiny = found["tiny.gguf"]
    assert (tiny.kind, tiny.architecture, tiny.quantisation) == ("llm", "llama", "F32")
    assert tiny.parameters == elements(models / "tiny.gguf")
    assert tiny.file_bytes == (models / "tiny.gguf").stat().st_size
    assert tiny.gpu_mb_full_offload is not None and tiny.gpu_mb_full_offload > 0
    assert found["sub/wide.gguf"].parameters == elements(models / "sub" / "wide.gguf") > tiny.parameters
    whisper = found["ggml-tiny.bin"]
    assert (whisper.kind, whisper.architecture, whisper.quantisation) == ("whisper", "whisper-tiny", "F16")
    assert found["broken.gguf"].error is not None and "GGUF" in found["broken.gguf"].error
    assert catalogue.catalogue(str(tmp_path / "missing")) == []


@pytest.fixture(scope="module")
def models_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    with reachable_tmp_root("appliance-models-") as root:
        models, outside = root / "models", root / "outside"
        models.mkdir()
        outside.mkdir()
        fill(models, outside)
        for path in (models, models / "sub"):
            os.chmod(path, 0o755)
        srv = start_server(
            tmp_path_factory.mktemp("catalogue"), SANDBOX_MODELS_DIR=str(models), SANDBOX_AUTH_TOKEN=TOKEN
        )
        yield srv, models
        srv.stop()


async def test_get_v1_models_lists_the_directory_behind_the_token(models_server: tuple[Server, Path]) -> None:
    srv, models = models_server
    assert srv.get("/v1/models")[0] == 401
    status, body = srv.get("/v1/models", TOKEN)
    assert status == 200, body
    doc = json.loads(body)
    assert doc["models_dir"] == str(models)
    listed = {m["name"]: m for m in doc["models"]}
    assert listed == {m.name: m.as_dict() for m in catalogue.catalogue(str(models))}
    assert "escape.gguf" not in listed
    async with AsyncClient(srv.url, TOKEN) as client:
        assert await client.models() == doc["models"]


def test_the_sync_client_lists_the_same_models(models_server: tuple[Server, Path]) -> None:
    srv, _ = models_server
    with Client(srv.url, TOKEN) as client:
        assert client.models() == json.loads(srv.get("/v1/models", TOKEN)[1])["models"]


async def test_jailed_code_gets_the_same_list_from_appliance_tools(
    models_server: tuple[Server, Path],
) -> None:
    srv, _ = models_server
    code = (
        "import json\nfrom appliance.tools import models\nprint(json.dumps([m.as_dict() for m in models()]))"
    )
    async with AsyncClient(srv.url, TOKEN) as client:
        ex = await client.execute(code)
    assert ex.status == "ok", (ex.stderr, ex.error)
    assert json.loads(ex.stdout) == json.loads(srv.get("/v1/models", TOKEN)[1])["models"]


async def test_a_model_outside_the_directory_is_refused_by_name_and_by_link(
    models_server: tuple[Server, Path],
) -> None:
    srv, models = models_server
    outside = models.parent / "outside" / "secret.gguf"
    code = (
        "from appliance.tools import load_llm, ModelError\n"
        f"for path in ({str(outside)!r}, 'escape.gguf', '../outside/secret.gguf'):\n"
        "    try:\n        load_llm(path)\n        print('loaded', path)\n"
        "    except ModelError as exc:\n        print('refused', 'outside the models directory' in str(exc))\n"
    )
    async with AsyncClient(srv.url, TOKEN) as client:
        ex = await client.execute(code)
    assert ex.status == "ok", (ex.stderr, ex.error)
    assert ex.stdout.splitlines() == ["refused True"] * 3
