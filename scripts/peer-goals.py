#!/usr/bin/env python3
"""Issue 16's goals, judged against one run of the peer suite (../shared/bench-peers/run.sh).

    python3 scripts/peer-goals.py OUT/all.jsonl [--json]

Reads the suite's JSON lines (one per system and job; a job run several times counts with its
median, as the suite's own summary does) and prints each goal with its figure and whether this
run meets it:

- elements on tmpfs at least 1.5x QEMU quorum in every column (IOPS for 4 KiB, MB/s for 1 MiB);
- elements on the disk (durable): 4 KiB writes at QD1 at most 250 us mean, at QD16 a p99 of at
  most 3x the mean and at least 0.5x the IOPS of the O_DIRECT export, 1 MiB writes at least
  600 MB/s (at QD1 and at QD16).

A goal whose rows are missing from the file (a run of some systems only) is reported as
missing, not judged. Exits 1 on a file it cannot read, 2 on wrong arguments.
"""

import json
import statistics
import sys

QUORUM = "qemu-quorum-best-fifo"
TMPFS = "starfish-tmpfs"
DISK = "starfish-disk"
DIRECT = "qemu-nbd-disk-direct"
# (job, name, the figure compared: IOPS for small I/O, MB/s for large)
COLUMNS = [
    ("rw4k_qd1", "4K write QD1", "iops"),
    ("rw4k_qd16", "4K write QD16", "iops"),
    ("rr4k_qd1", "4K read QD1", "iops"),
    ("rr4k_qd16", "4K read QD16", "iops"),
    ("sw1m_qd1", "1M write QD1", "MBps"),
    ("sw1m_qd16", "1M write QD16", "MBps"),
]
TMPFS_RATIO_MIN = 1.5
DURABLE_QD1_MEAN_US_MAX = 250
DURABLE_QD16_P99_RATIO_MAX = 3.0
DURABLE_QD16_DIRECT_RATIO_MIN = 0.5
DURABLE_1M_MBPS_MIN = 600


def load(path):
    """{(label, test): [row, ...]} from the suite's JSON lines."""
    rows = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key = (row["label"], row["test"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a row of the peer suite ({e})") from e
            rows.setdefault(key, []).append(row)
    return rows


def median(rows, label, test, key):
    values = [r[key] for r in rows.get((label, test), []) if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(values) if values else None


def judged(name, figure, *, at_least=None, at_most=None, digits=2):
    """A goal: `figure` (None: its rows are missing) against its bound."""
    wanted = f">= {at_least}" if at_least is not None else f"<= {at_most}"
    if figure is None:
        return {"goal": name, "figure": None, "wanted": wanted, "verdict": "missing"}
    met = figure >= at_least if at_least is not None else figure <= at_most
    shown = round(figure, digits) if digits else round(figure)
    return {"goal": name, "figure": shown, "wanted": wanted, "verdict": "met" if met else "missed"}


def ratio(ours, theirs):
    return None if ours is None or not theirs else ours / theirs


def judge(rows):
    """The goals, each with its figure (None where rows are missing) and verdict."""
    goals = [
        judged(f"tmpfs {name} / QEMU quorum", ratio(median(rows, TMPFS, test, key), median(rows, QUORUM, test, key)),
               at_least=TMPFS_RATIO_MIN)
        for test, name, key in COLUMNS
    ]

    def disk(test, key):
        return median(rows, DISK, test, key)

    goals.append(judged("durable 4K write QD1 mean (us)", disk("rw4k_qd1", "lat_mean_us"),
                        at_most=DURABLE_QD1_MEAN_US_MAX, digits=0))
    goals.append(judged("durable 4K write QD16 p99 / mean",
                        ratio(disk("rw4k_qd16", "lat_p99_us"), disk("rw4k_qd16", "lat_mean_us")),
                        at_most=DURABLE_QD16_P99_RATIO_MAX))
    goals.append(judged("durable 4K write QD16 / O_DIRECT export",
                        ratio(disk("rw4k_qd16", "iops"), median(rows, DIRECT, "rw4k_qd16", "iops")),
                        at_least=DURABLE_QD16_DIRECT_RATIO_MIN))
    for test, name in (("sw1m_qd1", "1M write QD1"), ("sw1m_qd16", "1M write QD16")):
        goals.append(judged(f"durable {name} (MB/s)", disk(test, "MBps"), at_least=DURABLE_1M_MBPS_MIN, digits=0))
    return goals


def main(argv):
    as_json = "--json" in argv
    args = [a for a in argv if a != "--json"]
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: peer-goals.py OUT/all.jsonl [--json]", file=sys.stderr)
        return 2
    try:
        goals = judge(load(args[0]))
    except (OSError, ValueError) as e:
        print(f"peer-goals: {e}", file=sys.stderr)
        return 1
    if as_json:
        for g in goals:
            print(json.dumps(g))
        return 0
    width = max(len(g["goal"]) for g in goals)
    for g in goals:
        figure = "-" if g["figure"] is None else g["figure"]
        print(f"{g['goal']:<{width}}  {figure!s:>7}  (goal {g['wanted']})  {g['verdict']}")
    judged = [g for g in goals if g["verdict"] != "missing"]
    print(f"met {sum(g['verdict'] == 'met' for g in judged)} of {len(judged)} goals judged"
          + (f"; {len(goals) - len(judged)} missing from the file" if len(judged) < len(goals) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
