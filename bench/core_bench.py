#!/usr/bin/env python3
"""Core data-path benchmark (issue 2): fio's nbd engine against the replicated volume (HE + 3
elements on loopback, no delay) and, in the same run, against the direct-attached baseline
(one unreplicated `nbdkit file` export over a file on the same disk), plus the latency of one
4 KiB write + fdatasync on that disk (what an element pays per group commit).

Prints a Markdown table; `--json FILE` also writes the raw figures. Figures, not assertions.

    python3 bench/core_bench.py [--runtime 10] [--size 1GiB] [--json out.json]
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("STARFISH_BIN", os.path.join(ROOT, "target", "release", "starfish"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def wait_in_sync(admin, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run([BIN, "status", "--admin", f"127.0.0.1:{admin}", "--json"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            doc = json.loads(out.stdout)
            if all(e["state"] == "in-sync" for e in doc["elements"]) and \
                    all(v["mode"] == "read-write" for v in doc["volumes"]):
                return
        time.sleep(0.2)
    raise RuntimeError("cluster did not get in sync")


JOBS = [
    # name, rw, bs, iodepth
    ("4k randwrite QD1", "randwrite", "4k", 1),
    ("4k randwrite QD16", "randwrite", "4k", 16),
    ("4k randread QD1", "randread", "4k", 1),
    ("4k randread QD16", "randread", "4k", 16),
    ("1M seq write QD8", "write", "1M", 8),
]


def fio(uri, name, rw, bs, iodepth, runtime, size):
    cmd = ["fio", "--name=" + name.replace(" ", "_"), "--ioengine=nbd", "--uri=" + uri,
           f"--rw={rw}", f"--bs={bs}", f"--iodepth={iodepth}", "--numjobs=1",
           f"--size={size}", f"--runtime={runtime}", "--time_based", "--ramp_time=1",
           "--output-format=json", "--randrepeat=0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 60)
    if out.returncode != 0:
        raise RuntimeError(f"fio failed on {uri}: {out.stderr[-2000:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    lat = side["clat_ns"] if side["clat_ns"]["N"] else side["lat_ns"]
    return {
        "iops": side["iops"],
        "mb_s": side["bw_bytes"] / 1e6,
        "lat_mean_us": side["lat_ns"]["mean"] / 1e3,
        "lat_p99_us": lat["percentile"].get("99.000000", 0) / 1e3,
    }


def fsync_latency(directory, runtime):
    path = os.path.join(directory, "fsync-probe")
    cmd = ["fio", "--name=fsync", "--filename=" + path, "--ioengine=sync", "--rw=randwrite",
           "--bs=4k", "--size=64M", "--fdatasync=1", f"--runtime={runtime}", "--time_based",
           "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 60)
    os.unlink(path)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    return job["write"]["lat_ns"]["mean"] / 1e3 + job["sync"]["lat_ns"]["mean"] / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--json")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="starfish-bench-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    procs = []
    try:
        ports = [free_port() for _ in range(5)]
        for i, name in enumerate(["local", "near", "far"]):
            procs.append(subprocess.Popen([BIN, "element", "--listen", f"127.0.0.1:{ports[i]}",
                                           "--data", os.path.join(work, name)],
                                          stderr=open(os.path.join(work, f"{name}.log"), "w")))
        for i in range(3):
            wait_port(ports[i])
        size = args.size.replace("GiB", "G").replace("MiB", "M")
        procs.append(subprocess.Popen([BIN, "host", "--nbd", f"127.0.0.1:{ports[3]}", "--admin",
                                       f"127.0.0.1:{ports[4]}", "--quorum", "2",
                                       "--element", f"local=127.0.0.1:{ports[0]}",
                                       "--element", f"near=127.0.0.1:{ports[1]}",
                                       "--element", f"far=127.0.0.1:{ports[2]}",
                                       "--volume", f"vol0:{args.size}"],
                                      stderr=open(os.path.join(work, "host.log"), "w")))
        wait_port(ports[3])
        wait_in_sync(ports[4])
        base_port = free_port()
        base_file = os.path.join(work, "baseline.img")
        with open(base_file, "wb") as f:
            f.truncate(1 << 30 if "G" in size else int(size.rstrip("M")) << 20)
        procs.append(subprocess.Popen(["nbdkit", "-f", "-p", str(base_port), "-i", "127.0.0.1",
                                       "--exportname=vol0", "file", base_file]))
        wait_port(base_port)
        replicated = f"nbd://127.0.0.1:{ports[3]}/vol0"
        baseline = f"nbd://127.0.0.1:{base_port}/vol0"
        # Fill both once so reads hit real data, not holes.
        for uri in (replicated, baseline):
            subprocess.run(["fio", "--name=fill", "--ioengine=nbd", "--uri=" + uri, "--rw=write",
                            "--bs=1M", "--iodepth=8", f"--size={size}", "--output-format=terse"],
                           check=True, capture_output=True, timeout=600)
        rows = []
        for name, rw, bs, qd in JOBS:
            r = fio(replicated, name, rw, bs, qd, args.runtime, size)
            b = fio(baseline, name, rw, bs, qd, args.runtime, size)
            rows.append({"job": name, "starfish": r, "direct": b})
        fsync_us = fsync_latency(work, min(args.runtime, 5))
    except Exception:
        for log in ("host.log", "local.log", "near.log", "far.log"):
            path = os.path.join(work, log)
            if os.path.exists(path):
                print(f"--- {log} (warnings and errors)", file=sys.stderr)
                for line in open(path, errors="replace"):
                    if "WARN" in line or "ERROR" in line:
                        print(line.rstrip(), file=sys.stderr)
        raise
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"one 4 KiB write + fdatasync on this disk: {fsync_us:.0f} µs\n")
    print("| job | StarFish IOPS | MB/s | mean µs | p99 µs | direct IOPS | MB/s | mean µs | p99 µs | IOPS ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r, b = row["starfish"], row["direct"]
        print(f"| {row['job']} | {r['iops']:.0f} | {r['mb_s']:.1f} | {r['lat_mean_us']:.0f} | "
              f"{r['lat_p99_us']:.0f} | {b['iops']:.0f} | {b['mb_s']:.1f} | {b['lat_mean_us']:.0f} | "
              f"{b['lat_p99_us']:.0f} | {r['iops'] / b['iops']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fsync_us": fsync_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
