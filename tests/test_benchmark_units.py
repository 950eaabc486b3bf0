"""The benchmark report's pure parts: percentiles, summaries, the targets' verdicts, the pool's
idle test and the phase table; and the egress benchmark's floor relay, on loopback only (the
benchmarks themselves run in tests/test_benchmarks.py and tests/test_benchmark_probes.py)."""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path

import pytest

from benchmarks import egress, report
from benchmarks.appliance_server import profiles_full
from benchmarks.phases import Timeline
from benchmarks.stats import median_ratio, percentile, summarize


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([10.0, 0.0, 5.0], 100) == 10.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)


def test_median_ratio_gives_the_ratio_of_medians_inside_its_interval() -> None:
    a = [float(v) for v in range(1, 102)]
    assert median_ratio(a, a)[0] == 1.0
    assert median_ratio([3.0] * 50, [6.0] * 50) == (0.5, 0.5, 0.5)  # no spread: no doubt
    ratio, low, high = median_ratio(a, list(reversed(a)))
    assert low < ratio == 1.0 < high  # two samples of one spread: the interval holds 1 inside it
    assert median_ratio(a, a, seed=3) == median_ratio(a, a, seed=3)


def test_summary_orders_its_percentiles() -> None:
    s = summarize([float(v) for v in range(1, 101)])
    assert s.n == 100
    assert s.min_ms <= s.p50_ms <= s.p90_ms <= s.p99_ms <= s.max_ms
    assert s.p50_ms == pytest.approx(50.5)


def _results(  # noqa: PLR0913 (one figure per benchmark row)
    warm: float,
    naive: float,
    jupyter: float,
    pandas_warm: float,
    pandas_naive: float,
    runs_per_s: float,
    capacity: float,
    pss: float,
    eval_ratio: float = 0.9,
) -> dict[str, object]:
    def entry(p50: float) -> dict[str, float]:
        return {
            "n": 10,
            "p50_ms": p50,
            "p90_ms": p50 * 2,
            "p99_ms": p50 * 3,
            "mean_ms": p50,
            "min_ms": p50,
            "max_ms": p50 * 3,
        }

    return {
        "latency": {
            "print": {report.WARM: entry(warm), report.NAIVE: entry(naive), report.JUPYTER: entry(jupyter)},
            "pandas": {report.WARM: entry(pandas_warm), report.NAIVE: entry(pandas_naive)},
        },
        "throughput": {
            "spawn_capacity": {"spawns_per_s": capacity},
            "levels": [{"clients": 1, "runs_per_s": runs_per_s}],
        },
        "memory": {"pss_mb_per_warm_jail": pss},
        "eval": {"ratio": eval_ratio},
    }


def test_targets_pass_when_every_ratio_is_met() -> None:
    verdicts = [t.verdict() for t in report.targets(_results(1.5, 60, 4, 10, 800, 2.0, 2.1, 80))]
    assert verdicts == ["PASS"] * 7


def test_missed_targets_are_reported_not_raised() -> None:
    found = report.targets(_results(5.0, 200, 4, 100, 800, 1.0, 2.0, 200, eval_ratio=0.3))
    by_name = {t.name: t.verdict() for t in found}
    assert by_name["print(2+2) p50, warm pool (ms)"] == "MISS"
    assert by_name["print(2+2): warm Jupyter p50 / warm p50"] == "MISS"
    assert by_name["pandas cell: naive firejail p50 / warm p50"] == "MISS"
    assert by_name["peak sustained runs/s / jail-spawn capacity"] == "MISS"
    assert by_name["idle PSS per warm jail (MB)"] == "MISS"
    assert by_name["import-light eval runs/s: default / SANDBOX_PRELOAD=''"] == "MISS"
    assert by_name["print(2+2): naive firejail p50 / warm p50"] == "PASS"


def test_a_pool_is_idle_only_when_every_profile_holds_its_target() -> None:
    # Right after a run: the totals read "enough ready, none starting", the bare pool is one short.
    after_a_run = {
        "appliance_pool_ready": 3.0,
        "appliance_pool_starting": 0.0,
        'appliance_profile_pool_ready{profile="bare"}': 1.0,
        'appliance_profile_pool_target{profile="bare"}': 2.0,
        'appliance_profile_pool_ready{profile="science"}': 2.0,
        'appliance_profile_pool_target{profile="science"}': 2.0,
    }
    assert not profiles_full(after_a_run)
    refilled = {**after_a_run, 'appliance_profile_pool_ready{profile="bare"}': 2.0}
    assert profiles_full(refilled)
    grown = {**refilled, 'appliance_profile_pool_ready{profile="science"}': 5.0}
    assert profiles_full(grown)


def test_the_phase_table_takes_the_commonest_path_and_medians_its_gaps() -> None:
    timeline = Timeline()
    timeline.runs = [
        [("frame read", 0), ("send done>", 9_000)],  # the unwarm first run: skipped
        [("frame read", 0), ("op write>", 1_000), ("send done>", 3_000)],
        [("frame read", 0), ("op write>", 3_000), ("send done>", 4_000)],
        [("frame read", 0), ("op write>", 2_000), ("send done>", 6_000)],
        [("frame read", 0), ("cold jail", 1_000_000), ("send done>", 2_000_000)],  # another path
    ]
    table = timeline.table()
    assert table.startswith("3 of 4 runs took this path")
    assert "| 1 | `frame read` | `op write>` | 2 |" in table  # median of 1, 3, 2 µs
    assert "| 2 | `op write>` | `send done>` | 2 |" in table  # median of 2, 1, 4 µs
    assert "**4**" in table and "cold jail" not in table  # median whole: 3, 4, 6 µs


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("first", ["client", "far end"])
def test_the_floor_relay_carries_both_ways_whole_across_a_half_close(tmp_path: Path, first: str) -> None:
    """Through benchmarks/floor_relay.c, each way carries more than its 1 MiB pipe, whole; one
    side's half-close reaches the other as EOF while the way back stays open (`first` is
    the side that sends all and shuts down its writing first)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.fail("a C compiler is needed to build benchmarks/floor_relay.c (apt-get install gcc)")
    binary = egress.build_floor_relay(tmp_path)
    assert binary is not None
    up, down = os.urandom(3 * (1 << 20) + 12345), os.urandom(5 * (1 << 20) + 321)
    far_got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)

        def far_end() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(30)
                if first == "far end":
                    conn.sendall(down)
                    conn.shutdown(socket.SHUT_WR)
                far_got.append(_read_all(conn))
                if first == "client":
                    conn.sendall(down)

        thread = threading.Thread(target=far_end, daemon=True)
        thread.start()
        with egress.floor_relay(binary, "127.0.0.1", listener.getsockname()[1]) as port:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
                if first == "client":
                    client.sendall(up)
                    client.shutdown(socket.SHUT_WR)
                    got = _read_all(client)
                else:
                    got = _read_all(client)
                    client.sendall(up)
                    client.shutdown(socket.SHUT_WR)
                    assert client.recv(1) == b""  # the far end's close, once it has read all
            thread.join(30)
        assert not thread.is_alive()
    assert far_got == [up]
    assert len(got) == len(down) and got == down
    with pytest.raises(ConnectionRefusedError):  # the relay is gone with its context
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_the_relay_table_reads_the_floor_or_says_why_there_is_none() -> None:
    row = {"direct": 2.0, "splice": 3.0, "stream": 4.0, "floor": 2.5}
    table = "\n".join(egress._relay_table(row))
    assert "floor relay (C, splice)" in table and "floor / direct" in table
    assert "| 2.0 | 3.0 | 4.0 | 2.5 | x1.500 | x2.000 | x1.250 |" in table
    table = "\n".join(egress._relay_table(row | {"floor": None}))
    assert "| n/a (no cc) |" in table and table.endswith("| n/a |")


def test_the_connect_floor_answers_the_head_then_relays_what_followed_it(tmp_path: Path) -> None:
    """floor_relay --connect, the floor of a CONNECT proxy: the head is answered "200" whatever
    host it names, the far end is connected only after it, and bytes sent with the head go
    on first, then both ways whole."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.fail("a C compiler is needed to build benchmarks/floor_relay.c (apt-get install gcc)")
    binary = egress.build_floor_relay(tmp_path)
    assert binary is not None
    hello, down = b"first bytes\x00" * 100, os.urandom(2 * (1 << 20) + 7)
    far_got: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)
        with egress.floor_relay(binary, "127.0.0.1", listener.getsockname()[1], connect=True) as port:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
                listener.settimeout(0.5)
                with pytest.raises(TimeoutError):  # no far end before the head, as in a proxy
                    listener.accept()
                listener.settimeout(30)
                client.sendall(b"CONNECT somewhere.example:443 HTTP/1.1\r\nHost: x\r\n\r\n" + hello)
                reply = b""
                while not reply.endswith(b"\r\n\r\n"):
                    reply += client.recv(1)
                assert reply == b"HTTP/1.1 200 Connection established\r\n\r\n"
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(30)
                    conn.sendall(down)
                    conn.shutdown(socket.SHUT_WR)
                    client.shutdown(socket.SHUT_WR)
                    far_got.append(_read_all(conn))
                    got = _read_all(client)
    assert far_got == [hello]
    assert got == down


def test_the_sides_table_sets_the_floor_beside_the_proxy_and_the_verdict_names_it() -> None:
    side = {
        "http_mib_p50_ms": 2.0,
        "https_mib_p50_ms": 8.0,
        "small_100_p50_ms": 20.0,
        "n_big": 10,
        "n_runs": 6,
    }
    ratios = {"http_mib": 1.5, "https_mib": 1.125, "small_100": 2.0}
    summary = {
        "proxy": {**side, "http_mib_p50_ms": 3.0, "https_mib_p50_ms": 9.0, "small_100_p50_ms": 40.0},
        "direct": side,
        "ratios": ratios,
    }
    table = "\n".join(egress._sides_table(summary, 100))
    assert "| 1 MiB over HTTP (n=10) | 3.0 | 2.0 | x1.5 | n/a (no cc) | n/a |" in table
    assert egress._verdict("the unshaped veth", summary) == "the unshaped veth x1.5: not met"
    floor = {**side, "http_mib_p50_ms": 2.2}
    summary |= {"floor": floor, "floor_ratios": {"http_mib": 1.1, "https_mib": 1.0, "small_100": 1.2}}
    table = "\n".join(egress._sides_table(summary, 100, "1000 Mbit/s"))
    assert "| 1000 Mbit/s | 1 MiB over HTTP (n=10) | 3.0 | 2.0 | x1.5 | 2.2 | x1.1 |" in table
    assert table.startswith("| link | what |")
    assert egress._verdict("1000 Mbit/s", summary) == "1000 Mbit/s x1.5: not met (the floor relay x1.1)"


def test_the_summary_gives_the_floor_its_ratios_over_by_ip_as_the_proxy_has() -> None:
    def side(http: float, https: float, small: float) -> dict[str, list[float]]:
        return {"http_mib": [http], "https_mib": [https], "small_total": [small], "cpu_s": [0.1]}

    got = {"proxy": side(3.0, 9.0, 40.0), "direct": side(2.0, 8.0, 20.0)}
    assert "floor_ratios" not in egress._summary(got, 10)
    summary = egress._summary(got | {"floor": side(2.5, 8.8, 30.0)}, 10)
    assert summary["ratios"] == {"http_mib": 1.5, "https_mib": 1.125, "small_100": 2.0}
    assert summary["floor_ratios"] == {"http_mib": 1.25, "https_mib": 1.1, "small_100": 1.5}
