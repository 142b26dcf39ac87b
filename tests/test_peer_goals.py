"""`scripts/peer-goals.py`: issue 16's goals judged against the peer suite's JSON lines. Fed
made-up rows (no benchmark runs here), it must compute each ratio, judge it against its goal,
take the median of repeated passes, and say what is missing or malformed."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "peer-goals.py")
TESTS = ["rw4k_qd1", "rw4k_qd16", "rr4k_qd1", "rr4k_qd16", "sw1m_qd1", "sw1m_qd16"]


def row(label, test, iops=1000.0, mbps=100.0, mean=100.0, p99=200.0):
    return {"label": label, "test": test, "iops": iops, "MBps": mbps, "lat_mean_us": mean, "lat_p99_us": p99}


def goals(tmp_path, rows, *extra):
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = subprocess.run([sys.executable, SCRIPT, str(path), "--json", *extra], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return {g["goal"]: (g["figure"], g["verdict"]) for g in map(json.loads, result.stdout.splitlines())}


def full_run():
    rows = [row("qemu-quorum-best-fifo", t, iops=1000.0, mbps=600.0) for t in TESTS]
    rows += [row("qemu-nbd-disk-direct", t, iops=20000.0) for t in TESTS]
    # tmpfs: exactly 1.5x at 4K writes QD1, just below at QD16, 2x at 4K reads, 1M at 0.8x / 1.6x.
    ours = {"rw4k_qd1": 1500.0, "rw4k_qd16": 1490.0, "rr4k_qd1": 2000.0, "rr4k_qd16": 2000.0}
    rows += [row("starfish-tmpfs", t, iops=ours.get(t, 1.0), mbps={"sw1m_qd1": 480.0, "sw1m_qd16": 960.0}.get(t, 1.0)) for t in TESTS]
    rows += [
        row("starfish-disk", "rw4k_qd1", mean=250.0),
        row("starfish-disk", "rw4k_qd16", iops=9000.0, mean=2000.0, p99=6200.0),
        row("starfish-disk", "sw1m_qd1", mbps=600.0),
        row("starfish-disk", "sw1m_qd16", mbps=599.0),
    ]
    return rows


def test_each_goal_is_judged_with_its_figure(tmp_path):
    g = goals(tmp_path, full_run())
    assert g["tmpfs 4K write QD1 / QEMU quorum"] == (1.5, "met")
    assert g["tmpfs 4K write QD16 / QEMU quorum"] == (1.49, "missed")
    assert g["tmpfs 4K read QD1 / QEMU quorum"] == (2.0, "met")
    assert g["tmpfs 1M write QD1 / QEMU quorum"] == (0.8, "missed")
    assert g["tmpfs 1M write QD16 / QEMU quorum"] == (1.6, "met")
    assert g["durable 4K write QD1 mean (us)"] == (250, "met")
    assert g["durable 4K write QD16 p99 / mean"] == (3.1, "missed")
    assert g["durable 4K write QD16 / O_DIRECT export"] == (0.45, "missed")
    assert g["durable 1M write QD1 (MB/s)"] == (600, "met")
    assert g["durable 1M write QD16 (MB/s)"] == (599, "missed")


def test_repeated_passes_count_with_their_median(tmp_path):
    rows = full_run() + [row("starfish-tmpfs", "rw4k_qd1", iops=v) for v in (3000.0, 100.0)]
    # tmpfs 4K writes QD1 now 100, 1500 and 3000 IOPS: the median, 1500, decides.
    assert goals(tmp_path, rows)["tmpfs 4K write QD1 / QEMU quorum"] == (1.5, "met")


def test_a_run_of_some_systems_reports_the_rest_missing(tmp_path):
    rows = [r for r in full_run() if r["label"] != "qemu-quorum-best-fifo"]
    g = goals(tmp_path, rows)
    assert g["tmpfs 4K write QD1 / QEMU quorum"] == (None, "missing")
    assert g["durable 4K write QD1 mean (us)"] == (250, "met")
    path = tmp_path / "all.jsonl"
    text = subprocess.run([sys.executable, SCRIPT, str(path)], capture_output=True, text=True, timeout=30).stdout
    assert "met 2 of 5 goals judged; 6 missing from the file" in text, text


def test_a_malformed_line_is_a_clear_error(tmp_path):
    path = tmp_path / "all.jsonl"
    path.write_text(json.dumps(row("starfish-tmpfs", "rw4k_qd1")) + "\n{not json\n")
    result = subprocess.run([sys.executable, SCRIPT, str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert "all.jsonl:2: not a row of the peer suite" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
