"""`starfish bench t5|t6|t7|smfs|volume-ops --quick --json`: the benchmark driver runs end to end
against real processes and prints one JSON object per row with the documented
keys. A benchmark reports figures; this test only checks that they are there
and positive, never their values or ratios."""

import json
import os
import subprocess

import pytest

from conftest import require_tools

COMMON_KEYS = {"table", "config", "quorum", "elements"}
BASELINES = {"direct", "near_disk"}


def bench_rows(starfish_bin, workdir, table, timeout):
    result = subprocess.run(
        [starfish_bin, "bench", table, "--quick", "--json", "--work-dir", workdir],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert rows, f"no rows\n{result.stderr[-4000:]}"
    for row in rows:
        assert row["table"] == table, row
        assert COMMON_KEYS <= row.keys(), row
    # Nothing left behind in the work directory.
    assert os.listdir(workdir) == [], os.listdir(workdir)
    return rows


def positive(row, *keys):
    for key in keys:
        assert isinstance(row.get(key), (int, float)) and row[key] > 0, (key, row)


def starfish_rows(rows):
    replicated = [r for r in rows if r["config"] not in BASELINES]
    assert replicated, rows
    assert {r["config"] for r in rows} >= BASELINES, rows
    return replicated


@pytest.mark.time_limit(180)
def test_bench_t5_quick(starfish_bin, workdir):
    require_tools("fio")
    rows = bench_rows(starfish_bin, workdir, "t5", 170)
    for row in rows:
        positive(row, "write_latency_ms")
    for row in starfish_rows(rows):
        assert row["elements"] == 3 and row["quorum"] in (1, 2), row
        positive(row, "near_delay_ms", "far_delay_ms", "direct_write_latency_ms", "near_disk_write_latency_ms")


@pytest.mark.time_limit(180)
def test_bench_t6_quick(starfish_bin, workdir):
    require_tools("fio")
    rows = bench_rows(starfish_bin, workdir, "t6", 170)
    assert {r["op"] for r in rows} == {"read_hit", "read_miss", "write"}, rows
    for row in rows:
        key = "write_latency_ms" if row["op"] == "write" else "read_latency_ms"
        positive(row, key, "throughput_mb_s")
    for row in starfish_rows(rows):
        key = "write_latency_ms" if row["op"] == "write" else "read_latency_ms"
        positive(row, "direct_" + key, "near_disk_" + key, "direct_throughput_mb_s", "near_disk_throughput_mb_s")


@pytest.mark.time_limit(240)
def test_bench_t7_quick(starfish_bin, workdir):
    require_tools("fio", "nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "mount", "umount", "postmark", "stdbuf")
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("loop devices and mount need root")
    rows = bench_rows(starfish_bin, workdir, "t7", 230)
    for row in rows:
        positive(row, "postmark_tps")
    for row in starfish_rows(rows):
        positive(row, "near_delay_ms", "direct_postmark_tps", "near_disk_postmark_tps", "fraction_of_direct")


@pytest.mark.time_limit(180)
def test_bench_smfs_quick(starfish_bin, workdir):
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("the emulated WAN link needs root and /dev/net/tun")
    rows = bench_rows(starfish_bin, workdir, "smfs", 170)
    disasters = {r["mode"]: r for r in rows if r["kind"] == "disaster"}
    assert set(disasters) == {"local-sync", "network-sync"}, rows
    for row in disasters.values():
        positive(row, "acked")
        assert 0 <= row["acked_lost"] <= row["acked"], row
    # The promise of network-sync (not a figure): every write acknowledged had its data and
    # repair packets on the wire, so the far site holds it after the primary site is gone.
    assert disasters["network-sync"]["acked_lost"] == 0, disasters["network-sync"]
    assert disasters["network-sync"]["fec_c"] == 3
    for row in rows:
        if row["kind"] == "latency":
            positive(row, "writes", "p50_ms", "p99_ms")
        elif row["kind"] == "throughput":
            positive(row, "acked_mbit_s", "far_mbit_s")


@pytest.mark.time_limit(200)
def test_bench_volume_ops_quick(starfish_bin, workdir):
    rows = bench_rows(starfish_bin, workdir, "volume-ops", 180)
    cost = [r for r in rows if r["op"] == "snapshot-cost"]
    clone = [r for r in rows if r["op"] == "clone-cost"]
    rows = [r for r in rows if r["op"] not in ("snapshot-cost", "clone-cost")]
    assert {(r["snapshots"], r["rw"]) for r in cost} == {
        (n, rw) for n in (0, 1, 8) for rw in ("randwrite-4k", "write-1m")}, cost
    assert {r["rw"] for r in clone} == {"randwrite-4k", "write-1m"}, clone
    for row in cost + clone:
        positive(row, "iops", "latency_mean_ms", "throughput_mb_s")
    for row in clone:
        positive(row, "clone_ms")
    expected = {
        (op, p, load)
        for op in ("create", "grow", "shrink", "delete")
        for p in ("none", "single", "group")
        for load in (20, 100)
        if p != "none" or op in ("create", "delete")
    }
    assert {(r["op"], r["policy"], r["offered_ops_s"]) for r in rows} == expected, rows
    for row in rows:
        positive(row, "achieved_ops_s", "latency_mean_ms", "latency_p50_ms", "latency_p99_ms")
        assert row["failed"] == 0, row


@pytest.mark.time_limit(60)
def test_bench_missing_tool_is_a_clear_error(starfish_bin, workdir):
    """Without fio on PATH the bench names the package instead of panicking."""
    empty = os.path.join(workdir, "empty-path")
    os.makedirs(empty)
    result = subprocess.run(
        [starfish_bin, "bench", "t5", "--quick", "--work-dir", workdir],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PATH": empty},
    )
    assert result.returncode != 0
    assert "fio" in result.stderr and "panicked" not in result.stderr, result.stderr
