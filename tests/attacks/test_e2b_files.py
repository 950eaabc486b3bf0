"""E2B's files under abuse: the server reaches a sandbox's files as root, from outside its
jail, through `sandbox.files` (envd's Filesystem service) and `/files`. The jailed code
plants links to the host, FIFOs and huge trees; a client uploads more than the disk holds;
another tenant and a wrong token knock. Nothing may be read, written, listed or removed
outside the sandbox's own working directory, and the server stays up for the others."""

from __future__ import annotations

import gzip
import hashlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2b import FileType, NotFoundException, SandboxException
from e2b_code_interpreter import Sandbox

from tests.attacks.common import AWS_SECRET, attack
from tests.support import Server, start_server
from tests.test_e2b_sdk import ALICE, BOB, point_sdk, tenants_file, until

Observe = Callable[[str], None]
DISK_MB = 64  # SANDBOX_MAX_DISK_MB, as hostile_server has it


@pytest.fixture(scope="module")
def e2bsrv(tmp_path_factory: pytest.TempPathFactory, tmp_root: Path) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("e2b-files-attacks")
    # hostile_server's limits that matter here, with tenants instead of its one token
    srv = start_server(
        base,
        SANDBOX_TMP_ROOT=str(tmp_root),
        SANDBOX_AUTH_TOKENS_FILE=str(tenants_file(base)),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MAX_DISK_MB=str(DISK_MB),
        SANDBOX_MAX_EXEC_MS="20000",
        SANDBOX_CLIENT_STALL_MS="1000",
        AWS_SECRET_ACCESS_KEY=AWS_SECRET,
    )
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def sdk_env(e2bsrv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    point_sdk(monkeypatch, e2bsrv)


@pytest.fixture(scope="module")
def planted(e2bsrv: Server) -> Iterator[Sandbox]:
    """A sandbox whose code planted links to the host and a FIFO in its working directory."""
    mp = pytest.MonkeyPatch()
    point_sdk(mp, e2bsrv)
    sb = Sandbox.create()
    ran = sb.run_code(
        "import os\n"
        "os.symlink('/etc/shadow', 'shadow')\n"
        "os.symlink('/', 'hostroot')\n"
        "os.symlink('/etc', 'etcdir')\n"
        "os.mkfifo('fifo')\n"
        "os.makedirs('real/sub')\n"
        "open('real/ok.txt', 'w').write('mine')\n"
        "os.symlink('/etc', 'real/sub/up')\n"
        "'planted'"
    )
    assert ran.text == "'planted'", ran.error
    yield sb
    sb.kill()
    mp.undo()


def digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@attack(
    "read and list through links the sandbox planted to /etc/shadow and the host's /",
    "the sandbox's own file reads; each link is refused or listed as a link, nothing of the host comes back",
)
def test_reading_and_listing_through_planted_links_escapes_nothing(
    planted: Sandbox, observe: Observe
) -> None:
    files = planted.files
    assert files.read("real/ok.txt") == "mine"  # the control: the sandbox's own file
    refused = []
    for path in (
        "shadow",
        "/home/user/shadow",
        "hostroot/etc/shadow",
        "etcdir/passwd",
        "real/sub/up/passwd",
        "fifo",
    ):
        with pytest.raises(SandboxException) as caught:
            files.read(path)
        refused.append(f"{path}: {type(caught.value).__name__}")
        assert "root:" not in str(caught.value)
    for path in ("hostroot", "etcdir", "hostroot/etc", "real/sub/up"):
        with pytest.raises(SandboxException):
            files.list(path)
    info = files.get_info("shadow")
    assert info.type == FileType.SYMLINK and info.symlink_target == "/etc/shadow" and info.size < 64
    listed = {e.path: e.type for e in files.list("/home/user", depth=10)}
    assert listed["/home/user/hostroot"] == FileType.SYMLINK
    assert listed["/home/user/real/sub/up"] == FileType.SYMLINK
    assert not [
        p
        for p in listed
        if p.startswith(("/home/user/hostroot/", "/home/user/etcdir/", "/home/user/real/sub/up/"))
    ]
    observe("; ".join(refused) + f"; a depth-10 listing held {len(listed)} entries, none through a link")


@attack(
    "write, make_dir, rename and remove through planted links",
    "a write over a link replaces the link; nothing through one reaches the host; /etc unchanged",
)
def test_writing_through_planted_links_touches_nothing_of_the_host(
    planted: Sandbox, observe: Observe
) -> None:
    files = planted.files
    before = {p: digest(p) for p in ("/etc/shadow", "/etc/passwd")}
    for path in (
        "etcdir/appliance-e2b-evil",
        "hostroot/tmp/appliance-e2b-evil",
        "real/sub/up/appliance-e2b-evil",
    ):
        with pytest.raises(SandboxException):
            files.write(path, "pwned")
    for path in ("etcdir/appliance-e2b-dir", "hostroot/tmp/appliance-e2b-dir"):
        with pytest.raises(SandboxException):
            files.make_dir(path)
    with pytest.raises(SandboxException):
        files.rename("hostroot/etc/passwd", "stolen")
    with pytest.raises(SandboxException):
        files.remove("etcdir/passwd")
    with pytest.raises(SandboxException):
        files.write_files([{"path": "/home/user/../../etc/appliance-e2b-evil", "data": "x"}])
    # A write over the link to /etc/shadow replaces the link in the sandbox, not the host's file.
    files.write("shadow", "the sandbox's own now")
    assert files.get_info("shadow").type == FileType.FILE
    assert files.read("shadow") == "the sandbox's own now"
    files.remove("etcdir")  # the link, not /etc
    assert not files.exists("etcdir")
    assert {p: digest(p) for p in before} == before
    for leftover in (
        "/etc/appliance-e2b-evil",
        "/tmp/appliance-e2b-evil",
        "/etc/appliance-e2b-dir",
        "/tmp/appliance-e2b-dir",
    ):
        assert not Path(leftover).exists(), leftover
    assert Path("/etc/passwd").exists()
    observe(
        "/etc/shadow and /etc/passwd unchanged; writes through links refused; the link over /etc/shadow replaced in place"
    )


@attack(
    "upload more than the sandbox's disk holds, streamed, then a deep and a wide tree to list",
    "the upload is refused without a partial file left, the listing past its cap refused, the server up",
)
def test_a_huge_upload_and_a_huge_listing_are_refused(e2bsrv: Server, observe: Observe) -> None:
    sb = Sandbox.create()
    try:
        chunk = b"\0" * (1 << 20)

        def body() -> Iterator[bytes]:
            for _ in range(DISK_MB + 16):
                yield chunk

        with pytest.raises(SandboxException) as caught:
            sb.files.write("big.bin", body())
        left = [e.name for e in sb.files.list("/home/user")]  # nothing partial, nothing temporary
        assert not [n for n in left if n == "big.bin" or n.startswith(".appliance-upload")], left
        made = sb.run_code(
            "import os\n"
            "os.makedirs('wide')\n"
            "for i in range(10_050): open(f'wide/{i}', 'w').close()\n"
            "p = 'deep'\n"
            "for _ in range(300): p += '/d'\n"
            "os.makedirs(p)\n"
            "'made'"
        )
        assert made.text == "'made'", made.error
        with pytest.raises(SandboxException, match="more than 10000 entries"):
            sb.files.list("wide")
        deep = sb.files.list("deep", depth=1000)  # bounded at 128 levels
        assert len(deep) == 128
        sb.files.write("after.txt", "still here")
        assert sb.files.read("after.txt") == "still here"
        observe(
            f"{DISK_MB + 16} MiB upload: {type(caught.value).__name__}; 10,050 entries refused; 300-deep tree listed to 128"
        )
    finally:
        sb.kill()


@attack(
    "another tenant's sandbox, a wrong token, an ended sandbox: envd's Connect calls and /files",
    "each gets the same not found as a sandbox that never existed; the owner's own call works",
)
def test_another_tenants_sandbox_is_unreachable(
    e2bsrv: Server, observe: Observe, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("E2B_API_KEY", BOB)
    bobs = Sandbox.create()
    monkeypatch.setenv("E2B_API_KEY", ALICE)
    alices = Sandbox.create()
    try:
        bobs.files.write("secret.txt", "bob's")
        alice_token = str(alices._envd_access_token)

        def call(sandbox_id: str, token: str) -> tuple[int, int]:
            headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
            rpc = httpx.post(
                e2bsrv.http + "/e2b/filesystem.Filesystem/ListDir",
                json={"path": "/home/user"},
                headers=headers,
            )
            got = httpx.get(e2bsrv.http + "/e2b/files", params={"path": "secret.txt"}, headers=headers)
            return rpc.status_code, got.status_code

        assert call(bobs.sandbox_id, str(bobs._envd_access_token)) == (200, 200)  # the control
        outcomes = {
            "alice's token on bob's sandbox": call(bobs.sandbox_id, alice_token),
            "a wrong token": call(bobs.sandbox_id, "x" * 43),
            "no such sandbox": call("0" * 20, alice_token),
        }
        assert all(o == (404, 404) for o in outcomes.values()), outcomes
        with pytest.raises(NotFoundException):
            Sandbox.connect(bobs.sandbox_id)  # alice's key does not even find it
        bobs.kill()
        assert call(bobs.sandbox_id, str(bobs._envd_access_token)) == (404, 404)
        observe("; ".join(f"{k}: {v}" for k, v in outcomes.items()) + "; bob's, once killed: 404")
    finally:
        alices.kill()
        bobs.kill()


@attack(
    "oversized and compressed-bomb Connect messages to envd, with and without the sandbox's token",
    "refused before decoding (not_found without the token, resource_exhausted past 1 MiB), the server up",
)
def test_oversized_connect_messages_are_refused(e2bsrv: Server, observe: Observe) -> None:
    sb = Sandbox.create()
    try:
        url = e2bsrv.http + "/e2b/filesystem.Filesystem/Stat"
        good = {
            "E2b-Sandbox-Id": sb.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": str(sb._envd_access_token),
        }
        huge = b'{"path": "' + b"a" * (2 << 20) + b'"}'
        bomb = gzip.compress(b'{"path": "' + b"b" * (64 << 20) + b'"}')  # 64 MiB in about 64 KiB
        outcomes = {
            "2 MiB, wrong token": httpx.post(
                url, content=huge, headers={**good, "X-Access-Token": "x", "Content-Type": "application/json"}
            ),
            "2 MiB": httpx.post(url, content=huge, headers={**good, "Content-Type": "application/json"}),
            "gzip bomb": httpx.post(
                url,
                content=bomb,
                headers={**good, "Content-Type": "application/json", "Content-Encoding": "gzip"},
            ),
        }
        codes = {k: r.json().get("code") for k, r in outcomes.items()}
        assert codes == {
            "2 MiB, wrong token": "not_found",
            "2 MiB": "resource_exhausted",
            "gzip bomb": "resource_exhausted",
        }
        assert sb.files.make_dir("still-served")  # the control, after the abuse
        observe(f"{codes}; the sandbox's next call served")
    finally:
        sb.kill()


@attack(
    "download a big file and never read the reply",
    "the server drops the connection after SANDBOX_CLIENT_STALL_MS, holding nothing; others are served meanwhile",
)
def test_a_download_never_read_is_dropped(e2bsrv: Server, observe: Observe) -> None:
    sb = Sandbox.create()
    try:
        size = 40 << 20  # more than the two ends' socket buffers hold: the server's writes stall
        made = sb.run_code(f"open('big.bin', 'wb').truncate({size}); 'made'")
        assert made.text == "'made'", made.error
        port = int(e2bsrv.http.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                f"GET /e2b/files?path=big.bin HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nE2b-Sandbox-Id: {sb.sandbox_id}\r\n"
                f"E2b-Sandbox-Port: 49983\r\nX-Access-Token: {sb._envd_access_token}\r\n\r\n".encode()
            )
            assert sb.files.read("big.bin", format="bytes")[:4] == bytearray(4)  # others are served meanwhile
            # The server's end of this connection leaves ESTABLISHED once the server lets it go.
            assert until(lambda: server_end_state(port, sock.getsockname()[1]) != "01", within_s=60), (
                "the stalled download was never dropped"
            )
        observe(f"a {size}-byte download never read: dropped after the stall; the sandbox served meanwhile")
    finally:
        sb.kill()


def server_end_state(server_port: int, client_port: int) -> str | None:
    """The TCP state (/proc/net/tcp's hex code; "01" is ESTABLISHED) of the server's end of a
    loopback connection, None once it is gone."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return fields[3]
    return None
