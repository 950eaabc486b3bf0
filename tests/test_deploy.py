"""Images and deployment files, checked without building an image.

The image itself is built and run by `scripts/ci-images.sh`. Here: hadolint on both
Dockerfiles, the Kubernetes manifests against the bundled schemas, the compose files, the
seccomp profile, and the entrypoint's privilege checks, driven with crafted inputs and, for
capabilities and no_new_privs, with the real kernel state of a process that lacks them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENTRYPOINT = REPO / "images" / "entrypoint.sh"
DOCKERFILES = [REPO / "images" / "cpu" / "Dockerfile", REPO / "images" / "cuda12" / "Dockerfile"]
K8S = REPO / "deploy" / "kubernetes"
# sha256 of Docker's default profile (moby/moby profiles/seccomp/default.json) in canonical JSON.
DOCKER_DEFAULT_SHA256 = "9af8d3aeaa836af0b750afd7ecdb490df8e04c47ca820f472794252396eaa6ea"
# Docker's default capabilities, as a CapBnd mask, and the two the jail adds; podman's default
# lacks MKNOD (and AUDIT_WRITE, NET_RAW), which --private-dev needs.
DOCKER_DEFAULT_CAPS = 0xA80425FB
SYS_ADMIN, NET_ADMIN, MKNOD, SETPCAP = 1 << 21, 1 << 12, 1 << 27, 1 << 8
PODMAN_DEFAULT_CAPS = 0x800405FB
EX_CONFIG = 78


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """Render a kustomization with a real kustomize (kubectl's built-in one, kustomize v5)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed for its built-in kustomize (deploy/kubernetes is a kustomize base)")
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


# What `kubectl apply -k` gets: the CPU pool (base), the GPU pool, and what CI plays with podman.
RENDERED = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "podman": K8S / "overlays" / "podman"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rendered")
    paths = {}
    for name, directory in RENDERED.items():
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump_all(kustomize(directory)))
    return paths


def kube_docs(rendered: dict[str, Path], *names: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for n in names for d in load_all(rendered[n])}


def entrypoint(
    script: str, env: dict[str, str] | None = None, wrap: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Source the entrypoint as a library, then run `script` (bash) with its functions."""
    full_env = {"PATH": os.environ["PATH"], "APPLIANCE_ENTRYPOINT_LIB": "1", **(env or {})}
    cmd = (wrap or []) + ["bash", "-c", f'source "{ENTRYPOINT}"; {script}']
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=60)


class TestDockerfiles:
    def test_hadolint_finds_nothing_in_either_dockerfile(self) -> None:
        out = subprocess.run(
            [str(BIN / "hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stdout + out.stderr

    @pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
    def test_no_instruction_depends_on_the_docker_image_format(self, dockerfile: Path) -> None:
        """podman's default OCI format ignores SHELL: a pipefail set there would silently be
        dropped, so no RUN may rely on it (a piping RUN runs `bash -o pipefail -c` itself)."""
        instructions = [
            line.split(None, 1)[0] for line in dockerfile.read_text().splitlines() if line[:1].isalpha()
        ]
        assert "SHELL" not in instructions

    def test_hadolint_does_fail_on_a_bad_dockerfile(self, tmp_path: Path) -> None:
        bad = tmp_path / "Dockerfile"
        bad.write_text("FROM debian\nRUN apt-get install curl\n")
        out = subprocess.run([str(BIN / "hadolint"), str(bad)], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "DL3008" in out.stdout

    def test_cpu_image_serves_as_root_with_the_jail_contract(self) -> None:
        text = DOCKERFILES[0].read_text()
        assert "ARG BASE=python:3.11-slim" in text
        for needed in (
            "ENV container=docker",
            "EXPOSE 9100",
            "HEALTHCHECK",
            "/readyz",
            "USER 0",
            'useradd -l -u "${SANDBOX_UID}"',
            "-d /workspace",
            "ARG SANDBOX_UID=1001",
            "firejail",
            "SANDBOX_OUTPUTS_DIR=/workspace/outputs",
            "SANDBOX_MODELS_DIR=/srv/models",
            "llama-cpp-python",
            "pywhispercpp",
            "/tmp/src[science]",
            "-DGGML_NATIVE=OFF",
            "appliance-entrypoint",
        ):
            assert needed in text, needed
        assert "seaborn" not in text

    def test_cuda_image_is_built_on_devel_and_runs_on_runtime_without_heavy_frameworks(self) -> None:
        text = DOCKERFILES[1].read_text()
        froms = [line.split()[1] for line in text.splitlines() if line.startswith("FROM ")]
        assert "nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU}" in froms
        assert froms[-1] == "nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}"
        assert "ARG CUDA_VERSION=12." in text
        for needed in (
            "-DGGML_CUDA=on",
            "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}",
            'CUDA_ARCHITECTURES="75;80;86;89;90"',
            "GGML_CUDA=1",
            "SANDBOX_GPU=1",
            "PYTHON_VERSION=3.11",
            "ENV container=docker",
            "HEALTHCHECK",
            "EXPOSE 9100",
        ):
            assert needed in text, needed
        lowered = text.lower()
        assert "cudnn" not in lowered.replace("no cudnn", "")
        assert "torch" not in lowered.replace("no pytorch", "")

    def test_the_cuda_stub_link_still_resolves_where_the_smoke_step_mounts_it(self, tmp_path: Path) -> None:
        # The build stage links stubs/libcuda.so.1 -> libcuda.so; the runtime stage's smoke step
        # mounts that folder at /tmp/cuda-stubs, where an absolute link into /usr/local/cuda
        # (absent from the runtime image) dangles and llama_cpp finds no CUDA backend. The
        # Dockerfile's own `ln -s` is replayed in a folder, the folder is copied elsewhere as a
        # mount would show it, and the link must resolve there.
        text = DOCKERFILES[1].read_text()
        links = [
            line.split("ln -s", 1)[1].split("\\")[0].split() for line in text.splitlines() if "ln -s " in line
        ]
        assert len(links) == 1, links
        target, link = links[0]
        assert link == "/usr/local/cuda/lib64/stubs/libcuda.so.1", link
        build = tmp_path / "build-stubs"
        build.mkdir()
        (build / "libcuda.so").write_bytes(b"\x7fELF stub")
        (build / "libcuda.so.1").symlink_to(target)
        mounted = tmp_path / "runtime" / "tmp" / "cuda-stubs"
        shutil.copytree(build, mounted, symlinks=True)  # links kept as links, as a bind mount shows them
        assert (mounted / "libcuda.so.1").resolve() == (mounted / "libcuda.so").resolve()
        assert (mounted / "libcuda.so.1").read_bytes() == b"\x7fELF stub"
        smoke = text[text.index("target=/tmp/cuda-stubs") :]
        assert "test -e /tmp/cuda-stubs/libcuda.so.1" in smoke
        assert "llama_cpp, pywhispercpp.model" in smoke.split("backends.probe")[0]


class TestKubernetes:
    def test_every_rendered_manifest_is_valid_against_the_bundled_schemas(
        self, rendered: dict[str, Path]
    ) -> None:
        out = subprocess.run(
            [str(BIN / "kubernetes-validate"), "--strict", *map(str, rendered.values())],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.count("passed for resource") >= 18

    def test_the_validator_rejects_a_misspelt_field(self, rendered: dict[str, Path], tmp_path: Path) -> None:
        doc = kube_docs(rendered, "base")[("Deployment", "appliance")]
        doc["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilites"] = {}
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(doc))
        out = subprocess.run(
            [str(BIN / "kubernetes-validate"), "--strict", str(bad)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode != 0

    def test_the_gpu_pool_is_an_overlay_of_the_base_not_a_copy(self) -> None:
        # Only kustomizations and patches outside base/: no second full Deployment to drift.
        for path in K8S.rglob("*.yaml"):
            if "base" in path.parts:
                continue
            for doc in load_all(path):
                assert doc.get("kind") in ("Kustomization", "Component", "Deployment"), path
                if doc.get("kind") == "Deployment":
                    assert "selector" not in doc["spec"] and "securityContext" not in str(doc), path

    @pytest.mark.parametrize(
        ("pool", "name"), [("base", "appliance"), ("gpu", "appliance-gpu"), ("podman", "appliance")]
    )
    def test_deployment_grants_exactly_what_the_jail_needs(
        self, rendered: dict[str, Path], pool: str, name: str
    ) -> None:
        docs = kube_docs(rendered, pool)
        pod = docs[("Deployment", name)]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["capabilities"]["add"] == ["SYS_ADMIN", "NET_ADMIN", "MKNOD"]
        assert sc["allowPrivilegeEscalation"] is True and sc["privileged"] is False
        assert sc["runAsUser"] == 0
        assert sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
        assert sc["appArmorProfile"]["type"] == "Unconfined"
        assert container["ports"][0]["containerPort"] == 9100
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["models"]["readOnly"] is True and mounts["models"]["mountPath"] == "/srv/models"
        assert mounts["outputs"]["mountPath"] == "/workspace/outputs"
        token = next(e for e in container["env"] if e["name"] == "SANDBOX_AUTH_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "appliance-auth", "key": "token"}
        # The settings come from the ConfigMap the base generates, under its hashed name.
        (source,) = container["envFrom"]
        settings = docs[("ConfigMap", source["configMapRef"]["name"])]
        assert settings["data"]["SANDBOX_MAX_CONCURRENCY"] == "4"
        claim = next(v for v in pod["volumes"] if v["name"] == "models")["persistentVolumeClaim"]["claimName"]
        assert ("PersistentVolumeClaim", claim) in docs
        if pool != "podman":  # podman 4.3 ignores readiness probes; its overlay says so
            assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}

    def test_gpu_overlay_requests_a_gpu_turns_gpu_mode_on_and_selects_only_gpu_pods(
        self, rendered: dict[str, Path]
    ) -> None:
        docs = kube_docs(rendered, "gpu")
        deployment = docs[("Deployment", "appliance-gpu")]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["memory"] == "4Gi"  # the base's, merged
        assert {"name": "SANDBOX_GPU", "value": "1"} in container["env"]
        assert container["image"] == "appliance:cuda12"
        gpu_pods = {"app.kubernetes.io/name": "appliance", "app.kubernetes.io/component": "gpu"}
        assert deployment["spec"]["selector"]["matchLabels"] == gpu_pods
        assert deployment["spec"]["template"]["metadata"]["labels"] == gpu_pods
        (spread,) = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert spread["labelSelector"]["matchLabels"] == gpu_pods
        for name in ("appliance-gpu", "appliance-pods-gpu"):
            assert docs[("Service", name)]["spec"]["selector"] == gpu_pods
        assert docs[("PodDisruptionBudget", "appliance-gpu")]["spec"]["selector"]["matchLabels"] == gpu_pods
        hpa = docs[("HorizontalPodAutoscaler", "appliance-gpu")]["spec"]
        assert hpa["scaleTargetRef"]["name"] == "appliance-gpu" and hpa["maxReplicas"] == 4
        # The API's pods keep their own selector: the component label is not forced on them.
        (rule,) = docs[("NetworkPolicy", "appliance-gpu")]["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "api"}}}]

    def test_many_pods_sit_behind_one_service_with_a_headless_twin_for_sessions(
        self, rendered: dict[str, Path]
    ) -> None:
        docs = kube_docs(rendered, "base")
        assert docs[("Service", "appliance")]["spec"]["ports"][0]["port"] == 9100
        assert docs[("Service", "appliance-pods")]["spec"]["clusterIP"] == "None"
        hpa = docs[("HorizontalPodAutoscaler", "appliance")]["spec"]
        assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"] and hpa["minReplicas"] >= 2
        assert docs[("PodDisruptionBudget", "appliance")]["spec"]["maxUnavailable"] == 1

    def test_the_queue_depth_component_adds_its_metric_to_either_pool(self, tmp_path: Path) -> None:
        component = K8S / "optional" / "hpa-queue-depth"
        for pool, name in (("base", "appliance"), ("overlays/gpu", "appliance-gpu")):
            overlay = tmp_path / pool.replace("/", "-")
            overlay.mkdir()
            (overlay / "kustomization.yaml").write_text(
                yaml.safe_dump(
                    {
                        "resources": [os.path.relpath(K8S / pool, overlay)],
                        "components": [os.path.relpath(component, overlay)],
                    }
                )
            )
            (hpa,) = [d for d in kustomize(overlay) if d["kind"] == "HorizontalPodAutoscaler"]
            assert hpa["metadata"]["name"] == name
            metrics = hpa["spec"]["metrics"]
            assert metrics[0]["resource"]["name"] == "cpu"
            assert metrics[1]["pods"]["metric"]["name"] == "appliance_queue_depth"

    def test_podman_overlay_keeps_what_kube_play_runs_and_publishes_the_service_port(
        self, rendered: dict[str, Path]
    ) -> None:
        docs = kube_docs(rendered, "podman")
        assert {kind for kind, _ in docs} == {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment"}
        base = kube_docs(rendered, "base")[("Deployment", "appliance")]["spec"]["template"]["spec"]
        deployment = docs[("Deployment", "appliance")]
        assert deployment["spec"]["replicas"] == 1
        pod = deployment["spec"]["template"]["spec"]
        (container,), (base_container,) = pod["containers"], base["containers"]
        # Rendered from the base: everything but the port, the probe and the image is the same.
        for key in ("securityContext", "resources", "volumeMounts", "env", "envFrom", "readinessProbe"):
            assert container[key] == base_container[key], key
        assert pod["volumes"] == base["volumes"]
        service = docs[("Service", "appliance")]["spec"]["ports"][0]
        (port,) = container["ports"]
        assert port["name"] == service["targetPort"] and port["hostPort"] == service["port"] == 9100
        assert port["hostIP"] == "127.0.0.1"
        assert container["livenessProbe"]["exec"]["command"] == [
            "/usr/local/bin/appliance-healthcheck",
            "/healthz",
        ]
        assert container["image"] == "localhost/appliance:cpu-ci"

    def test_network_policy_admits_only_the_api_on_9100_and_no_egress(
        self, rendered: dict[str, Path]
    ) -> None:
        spec = kube_docs(rendered, "base")[("NetworkPolicy", "appliance")]["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        (rule,) = spec["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "api"}}}]
        assert rule["ports"] == [{"protocol": "TCP", "port": 9100}]
        assert spec["egress"] == []


class TestReadmeBlocksThatCiRuns:
    """scripts/ci-images.sh finds these README blocks by their markers and runs them."""

    @staticmethod
    def block(marker: str) -> list[str]:
        lines = (REPO / "README.md").read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- ci-images: {marker}"))
        assert lines[start + 1] == "```sh"
        end = lines.index("```", start + 2)
        return lines[start + 2 : end]

    def test_the_container_block_builds_runs_waits_and_uses_the_token_form(self) -> None:
        text = "\n".join(self.block("container commands"))
        assert text.startswith("docker build -f images/cpu/Dockerfile -t appliance:cpu .")
        assert "mkdir -p outputs models" in text  # podman refuses missing bind-mount sources
        run = text[text.index("docker run ") : text.index("appliance:cpu\n", text.index("docker run ")) + 13]
        for flag in (
            "--cap-add SYS_ADMIN",
            "--cap-add NET_ADMIN",
            "--cap-add MKNOD",
            "-p 127.0.0.1:9100:9100",
            "--security-opt seccomp=images/seccomp.json",
            "--name sandbox",
            "-e SANDBOX_AUTH_TOKEN=change-me-long-token",
        ):
            assert flag in run, flag
        assert "until curl -fsS http://127.0.0.1:9100/readyz" in text
        # websocat 1.13: -H=VALUE (with =); `-H VALUE` swallows the URL.
        assert (
            "| websocat -H='Authorization: Bearer change-me-long-token' ws://127.0.0.1:9100/exec"
            in text.splitlines()[-1]
        )

    def test_the_container_block_can_run_again(self) -> None:
        """A failed or earlier `docker run` leaves a container named sandbox: the block
        removes it first, so running it again does not fail with "name already in use"."""
        lines = self.block("container commands")
        run = next(i for i, line in enumerate(lines) if line.startswith("docker run "))
        assert "docker rm -f sandbox 2>/dev/null || true" in lines[run - 1]

    def test_the_blocks_rest_and_websocat_lines_print_4_against_a_real_server(self, tmp_path: Path) -> None:
        """The block's last commands, as written but for the port, against a real appliance
        with the block's token (the container itself is run by scripts/ci-images.sh)."""
        from tests.support import start_server

        lines = self.block("container commands")
        start = next(i for i, line in enumerate(lines) if line.startswith("curl -sS "))
        commands = "\n".join(lines[start:])
        assert "| websocat " in commands and "/v1/exec" in commands
        server = start_server(tmp_path, SANDBOX_AUTH_TOKEN="change-me-long-token")
        try:
            script = commands.replace("127.0.0.1:9100", f"127.0.0.1:{server.port}").replace(
                "| websocat ", f"| {BIN / 'websocat'} "
            )
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=120
            )
        finally:
            server.stop()
        assert out.returncode == 0, out.stderr
        printed = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        fours = [f for f in printed if f.get("type") == "stream" and f.get("text") == "4\n"]
        assert len(fours) == 2, out.stdout  # one from curl (REST), one from websocat
        assert [f["status"] for f in printed if f["type"] == "done"] == ["ok", "ok"]

    def test_the_seed_block_starts_with_the_seed_one_liner(self) -> None:
        assert self.block("seed one-liner")[0] == (
            """echo '{"code":"print(2+2)"}' | .venv/bin/websocat ws://localhost:9100/exec"""
        )


class TestCompose:
    def test_sandbox_service_has_privileges_limits_volumes_and_a_network_shared_with_api(self) -> None:
        compose = yaml.safe_load((REPO / "compose.yaml").read_text())
        sandbox, api = compose["services"]["sandbox"], compose["services"]["api"]
        assert sandbox["cap_add"] == ["SYS_ADMIN", "NET_ADMIN", "MKNOD"]
        assert "seccomp=./images/seccomp.json" in sandbox["security_opt"]
        assert (REPO / "images" / "seccomp.json").is_file()
        assert sandbox["deploy"]["resources"]["limits"] == {"cpus": "2.00", "memory": "4G"}
        assert "./outputs:/workspace/outputs" in sandbox["volumes"]
        assert "./models:/srv/models:ro" in sandbox["volumes"]
        assert sandbox["env_file"] == ".env" and api["env_file"] == ".env"
        assert set(sandbox["networks"]) & set(api["networks"])
        assert sandbox["build"]["dockerfile"] == "images/cpu/Dockerfile"
        env_example = (REPO / ".env.example").read_text()
        assert "SANDBOX_AUTH_TOKEN=" in env_example

    def test_ulimits_are_explicit_so_up_works_where_the_runtime_cannot_raise_them(self) -> None:
        sandbox = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["sandbox"]
        limits = sandbox["ulimits"]
        for name, least in (("nofile", 1024), ("nproc", 64)):  # what each jail needs
            assert limits[name]["soft"] == limits[name]["hard"] >= least, limits
        # The same values the README and docs/deploy.md give for `podman run`.
        flags = f"--ulimit nofile={limits['nofile']['hard']}:{limits['nofile']['hard']}"
        assert (
            flags in (REPO / "README.md").read_text() and flags in (REPO / "docs" / "deploy.md").read_text()
        )

    def test_the_health_check_does_not_depend_on_the_image_format(self) -> None:
        """podman's default OCI format drops the image's HEALTHCHECK, and `api` waits for
        service_healthy: compose carries the same check itself."""
        services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
        check = services["sandbox"]["healthcheck"]
        assert check["test"] == ["CMD", "/usr/local/bin/appliance-healthcheck", "/readyz"]
        assert 'CMD ["/usr/local/bin/appliance-healthcheck", "/readyz"]' in DOCKERFILES[0].read_text()
        assert services["api"]["depends_on"]["sandbox"]["condition"] == "service_healthy"

    def test_the_shutdown_grace_fits_every_way_of_stopping(self) -> None:
        """compose stop, podman-compose stop and a plain `podman stop` (10 s, which podman-compose
        never raises) must all leave the server its whole grace: one number everywhere."""
        sandbox = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["sandbox"]
        grace_ms = int(sandbox["environment"]["SANDBOX_SHUTDOWN_GRACE_MS"])
        stop_s = int(str(sandbox["stop_grace_period"]).removesuffix("s"))
        image = DOCKERFILES[0].read_text()
        assert (
            f"SANDBOX_SHUTDOWN_GRACE_MS={grace_ms}" in image
            and "SANDBOX_SHUTDOWN_GRACE_MS=" in DOCKERFILES[1].read_text()
        )
        assert grace_ms < stop_s * 1000 <= 10_000  # 10 s: a plain `docker stop` / `podman stop`
        gpu = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]["sandbox"]
        assert "stop_grace_period" not in gpu and "SANDBOX_SHUTDOWN_GRACE_MS" not in gpu["environment"]

    def test_gpu_file_reserves_nvidia_gpus_for_the_sandbox(self) -> None:
        gpu = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())["services"]["sandbox"]
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert gpu["environment"]["SANDBOX_GPU"] == "1"
        assert gpu["build"]["dockerfile"] == "images/cuda12/Dockerfile"


class TestSeccompProfile:
    def test_profile_is_dockers_default_unchanged_plus_one_rule_for_firejail(self) -> None:
        profile = json.loads((REPO / "images" / "seccomp.json").read_text())
        *docker, added = profile["syscalls"]
        base = dict(profile, syscalls=docker)
        digest = hashlib.sha256(json.dumps(base, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        assert digest == DOCKER_DEFAULT_SHA256
        assert added["names"] == ["clone", "mount", "umount2", "unshare"]
        assert added["action"] == "SCMP_ACT_ALLOW" and "includes" not in added and "args" not in added

    def test_profile_denies_by_default_and_never_unconditionally_allows_kernel_escape_hatches(self) -> None:
        profile = json.loads((REPO / "images" / "seccomp.json").read_text())
        assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
        unconditional = {
            n
            for r in profile["syscalls"]
            if r["action"] == "SCMP_ACT_ALLOW" and not r.get("includes") and not r.get("args")
            for n in r["names"]
        }
        for name in (
            "keyctl",
            "add_key",
            "bpf",
            "init_module",
            "kexec_load",
            "setns",
            "pivot_root",
            "ptrace",
            "open_by_handle_at",
            "reboot",
        ):
            assert name not in unconditional, name


class TestEntrypoint:
    def test_missing_caps_names_the_two_the_jail_adds_to_dockers_defaults(self) -> None:
        out = entrypoint(f"missing_caps {DOCKER_DEFAULT_CAPS:x}")
        assert out.stdout.split() == ["CAP_SYS_ADMIN", "CAP_NET_ADMIN"]
        full = DOCKER_DEFAULT_CAPS | SYS_ADMIN | NET_ADMIN
        assert entrypoint(f"missing_caps {full:x}").stdout == ""
        assert len(entrypoint("missing_caps 0").stdout.split()) == 11

    def test_missing_caps_names_mknod_under_podmans_default_set(self) -> None:
        out = entrypoint(f"missing_caps {PODMAN_DEFAULT_CAPS | SYS_ADMIN | NET_ADMIN:x}")
        assert out.stdout.split() == ["CAP_MKNOD"]

    @pytest.mark.parametrize(
        ("call", "message", "fix"),
        [
            (
                f"check_caps {DOCKER_DEFAULT_CAPS | NET_ADMIN:x}",
                "missing capability: CAP_SYS_ADMIN",
                "--cap-add SYS_ADMIN",
            ),
            (
                f"check_caps {DOCKER_DEFAULT_CAPS | SYS_ADMIN:x}",
                "missing capability: CAP_NET_ADMIN",
                "--cap-add NET_ADMIN",
            ),
            (
                f"check_caps {DOCKER_DEFAULT_CAPS:x}",
                "CAP_SYS_ADMIN CAP_NET_ADMIN",
                "--cap-add SYS_ADMIN --cap-add NET_ADMIN",
            ),
            ("check_container_env ''", "container is '', not 'docker'", "remove -e container="),
            ("check_container_env podman", "container is 'podman'", "ENV container=docker"),
            ("check_no_new_privs 1", "no_new_privs is set", "allowPrivilegeEscalation: true"),
            ("check_uid 1001", "runs as uid 1001", "remove --user"),
            (
                f"check_caps {(DOCKER_DEFAULT_CAPS | SYS_ADMIN | NET_ADMIN) & ~MKNOD:x}",
                "missing capability: CAP_MKNOD",
                "--cap-add MKNOD",
            ),
            (
                f"check_caps {(DOCKER_DEFAULT_CAPS | SYS_ADMIN | NET_ADMIN) & ~SETPCAP:x}",
                "missing capability: CAP_SETPCAP",
                "--cap-add SETPCAP",
            ),
            ("check_ulimits 512 100000", "hard limit of open files is 512", "--ulimit nofile=1024:1024"),
            ("check_ulimits unlimited 32", "hard limit of processes is 32", "--ulimit nproc=64:64"),
            (
                "check_namespaces_with_failing_unshare 2",
                "seccomp profile forbids creating namespaces",
                "seccomp=/path/to/images/seccomp.json",
            ),
            (
                "check_mount_with_failing_mount 'docker-default (enforce)'",
                "AppArmor profile",
                "apparmor=unconfined",
            ),
        ],
    )
    def test_each_refusal_exits_78_and_names_the_missing_flag(
        self, call: str, message: str, fix: str
    ) -> None:
        # Namespace and mount failures are provoked with stand-ins for unshare/mount that fail
        # like a seccomp or AppArmor denial does (EPERM), since this host permits both.
        fakes = (
            "unshare() { echo 'unshare: unshare failed: Operation not permitted' >&2; return 1; }; "
            'check_namespaces_with_failing_unshare() { check_namespaces "$1"; }; '
            'check_mount_with_failing_mount() { check_mount "$1"; }; '
        )
        if "failing_mount" in call:
            fakes = fakes.replace("unshare() {", "unshare_real() {") + (
                "unshare() { echo 'mount: /mnt: permission denied.' >&2; return 1; }; "
            )
        out = entrypoint(fakes + call)
        assert out.returncode == EX_CONFIG, out
        assert "appliance: cannot start:" in out.stderr and message in out.stderr, out.stderr
        assert fix in out.stderr, out.stderr

    def test_accepted_values_pass_silently(self) -> None:
        full = DOCKER_DEFAULT_CAPS | SYS_ADMIN | NET_ADMIN
        out = entrypoint(
            f"check_caps {full:x} && check_container_env docker && check_no_new_privs 0 "
            "&& check_uid 0 && echo passed"
        )
        assert out.returncode == 0 and out.stdout.strip() == "passed" and out.stderr == ""

    def test_status_field_reads_proc_status_lines(self, tmp_path: Path) -> None:
        status = tmp_path / "status"
        status.write_text("Name:\tbash\nNoNewPrivs:\t1\nCapBnd:\t00000000a82425fb\nSeccomp:\t2\n")
        out = entrypoint(f'status_field CapBnd "{status}"; status_field NoNewPrivs "{status}"')
        assert out.stdout.split() == ["00000000a82425fb", "1"]


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping capabilities for real needs root")
class TestEntrypointOnThisHost:
    """The checks against real kernel state: this host as is, then with a privilege removed."""

    def test_every_check_passes_on_this_host_as_root(self) -> None:
        if not shutil.which("firejail") or not os.stat("/usr/bin/firejail").st_mode & 0o4000:
            pytest.fail("firejail must be installed setuid (scripts/setup-system.sh) for this test")
        out = entrypoint("check_all && echo passed", env={"container": "docker"})
        assert out.returncode == 0 and out.stdout.strip() == "passed", out.stderr

    @pytest.mark.parametrize(
        ("cap", "flag"),
        [
            ("cap_sys_admin", "--cap-add SYS_ADMIN"),
            ("cap_net_admin", "--cap-add NET_ADMIN"),
            ("cap_mknod", "--cap-add MKNOD"),
            ("cap_setpcap", "--cap-add SETPCAP"),
        ],
    )
    def test_a_process_without_the_capability_is_refused_naming_it(self, cap: str, flag: str) -> None:
        capsh = shutil.which("capsh") or "/usr/sbin/capsh"
        out = entrypoint(
            "check_all",
            env={"container": "docker"},
            wrap=[capsh, f"--drop={cap}", "--", "-c", 'exec "$@"', "capsh"],
        )
        assert out.returncode == EX_CONFIG, out
        assert cap.upper() in out.stderr and flag in out.stderr, out.stderr

    @pytest.mark.parametrize(
        ("cap", "check", "message", "flag"),
        [
            ("cap_mknod", "check_mknod", "cannot create /dev/zero device", "--cap-add MKNOD"),
            ("cap_setpcap", "check_capbset_drop", "PR_CAPBSET_DROP", "--cap-add SETPCAP"),
        ],
    )
    def test_the_trial_of_what_firejail_does_fails_without_the_capability(
        self, cap: str, check: str, message: str, flag: str
    ) -> None:
        # The trial itself, not the mask check: it must fail for real when the kernel refuses.
        capsh = shutil.which("capsh") or "/usr/sbin/capsh"
        wrap = [capsh, f"--drop={cap}", "--", "-c", 'exec "$@"', "capsh"]
        assert entrypoint(check).returncode == 0
        out = entrypoint(check, env={"container": "docker"}, wrap=wrap)
        assert out.returncode == EX_CONFIG, out
        assert message in out.stderr and flag in out.stderr, out.stderr

    def test_a_process_with_no_new_privs_is_refused(self) -> None:
        out = entrypoint("check_all", env={"container": "docker"}, wrap=["setpriv", "--no-new-privs"])
        assert out.returncode == EX_CONFIG and "no_new_privs is set" in out.stderr, out.stderr


class TestWheelUnbundle:
    """images/wheel_unbundle.py, which the CUDA image and scripts/ci-cuda-packaging.sh run."""

    def test_top_level_libraries_leave_the_wheel_and_its_record(self, tmp_path: Path) -> None:
        src = tmp_path / "pkg-1.0-cp311-cp311-linux_x86_64.whl"
        names = [
            "_pkg.cpython-311-x86_64-linux-gnu.so",
            "libggml.so.0",
            "libwhisper.so.1.8.5",
            "pkg/__init__.py",
            "pkg/libkept.so",
            "pkg-1.0.dist-info/METADATA",
        ]
        with zipfile.ZipFile(src, "w") as z:
            for name in names:
                z.writestr(name, b"x")
            z.writestr("pkg-1.0.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in names))
        out = subprocess.run(
            [sys.executable, str(REPO / "images" / "wheel_unbundle.py"), str(src), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        with zipfile.ZipFile(tmp_path / "out" / src.name) as z:
            kept = set(z.namelist())
            record = z.read("pkg-1.0.dist-info/RECORD").decode()
        assert kept == {
            "_pkg.cpython-311-x86_64-linux-gnu.so",
            "pkg/__init__.py",
            "pkg/libkept.so",
            "pkg-1.0.dist-info/METADATA",
            "pkg-1.0.dist-info/RECORD",
        }
        assert "libggml.so.0" not in record and "libwhisper" not in record and "pkg/libkept.so" in record

    def test_a_wheel_without_top_level_libraries_is_an_error(self, tmp_path: Path) -> None:
        src = tmp_path / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(src, "w") as z:
            z.writestr("pkg/__init__.py", b"")
        out = subprocess.run(
            [sys.executable, str(REPO / "images" / "wheel_unbundle.py"), str(src), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and "no top-level shared library" in out.stderr
