#!/usr/bin/env python3
"""Recovery benchmark (issue 3; the paper's Table 8 in our terms), with real processes: elements,
a host element, `starfish link` proxies for the far link and fio's nbd engine for the load.

Measured in one run, side by side:
  1. full recovery on loopback: a wiped element (empty data directory) copies the written data
     set from a peer (copied bytes / time, volume bytes scanned / time); and an element only
     briefly down whose gap is older than every peer's (small) replay log: full recovery that
     copies only the blocks that differ;
  2. replay recovery on loopback: an element down while more than the write queue but less
     than the replay log is written;
  3. the same two over an emulated far link (one-way delay, rate) with N=2, Q=1: the source
     element sits behind the link proxy, the target is direct, so the target's copy or replay
     connection to the source crosses the link; rate as a fraction of the link rate;
  4. foreground 4 KiB random-write throughput (fio, QD16) while one element is continuously in
     full recovery (wiped and restarted again each time it gets in sync), against the same run
     with no recovery, unpaced and with `--recovery-rate`;
  5. replay recovery time as a fraction of the outage: an element down for T seconds under a
     steady rate-limited fio write load, restarted while the load goes on.

Prints a Markdown table; `--json FILE` also writes the raw figures. Figures, not assertions.

    python3 bench/recovery_bench.py [--quick] [--json out.json]
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
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("STARFISH_BIN", os.path.join(ROOT, "target", "release", "starfish"))
MiB = 1 << 20
POLL_SECONDS = 0.1


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


def mib(text):
    """'512MiB' / '2GiB' -> bytes."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def fio_size(nbytes):
    return f"{nbytes // MiB}M"


class Proc:
    """A started process with its log file; stopped by its own PID only."""

    def __init__(self, cmd, log_path, stdin=None):
        self.cmd = cmd
        self.log_path = log_path
        self.log = open(log_path, "a")
        self.popen = subprocess.Popen(cmd, stdin=stdin, stdout=self.log, stderr=self.log)

    def alive(self):
        return self.popen.poll() is None

    def kill9(self):
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)
        self.log.close()

    def stop(self, timeout=10):
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        if self.popen.stdin:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        self.log.close()


class Cluster:
    """Elements (some optionally behind a `starfish link` proxy) and one host element."""

    def __init__(self, work, tag, names, quorum, volume, write_queue, replay_log=None,
                 linked=()):
        self.work = os.path.join(work, tag)
        os.makedirs(self.work)
        self.tag = tag
        self.names = names
        self.quorum = quorum
        self.volume = volume
        self.write_queue = write_queue
        self.replay_log = replay_log
        self.element_ports = {n: free_port() for n in names}
        self.elements = {}
        self.links = {}
        self.link_ports = {n: free_port() for n in linked}
        self.host = None
        self.nbd_port = free_port()
        self.admin_port = free_port()
        self.uri = f"nbd://127.0.0.1:{self.nbd_port}/vol0"
        self.host_options = {}

    def data_dir(self, name):
        return os.path.join(self.work, name)

    def start_element(self, name):
        cmd = [BIN, "element", "--listen", f"127.0.0.1:{self.element_ports[name]}",
               "--data", self.data_dir(name)]
        if self.replay_log:
            cmd += ["--replay-log", self.replay_log]
        self.elements[name] = Proc(cmd, os.path.join(self.work, f"{name}.log"))
        wait_port(self.element_ports[name])

    def start_link(self, name):
        # Starts fast (no delay, no rate): data sets are written at loopback speed and the link
        # is slowed with `set` just before the recovery that is measured.
        cmd = [BIN, "link", "--listen", f"127.0.0.1:{self.link_ports[name]}",
               "--target", f"127.0.0.1:{self.element_ports[name]}", "--delay-ms", "0"]
        self.links[name] = Proc(cmd, os.path.join(self.work, f"link-{name}.log"),
                                stdin=subprocess.PIPE)
        wait_port(self.link_ports[name])

    def set_link(self, name, delay_ms, rate_mbit):
        line = f"set --delay-ms {delay_ms} --rate-mbit {rate_mbit if rate_mbit else 'none'}\n"
        self.links[name].popen.stdin.write(line.encode())
        self.links[name].popen.stdin.flush()
        time.sleep(0.2)

    def link_stats(self, name):
        """The proxy's own counters (JSON line answered to `stats`), or None."""
        proc = self.links[name]
        with open(proc.log_path) as f:
            before = f.read().count("\n")
        proc.popen.stdin.write(b"stats\n")
        proc.popen.stdin.flush()
        deadline = time.time() + 3
        while time.time() < deadline:
            with open(proc.log_path) as f:
                lines = f.read().splitlines()
            for line in lines[before:]:
                if line.startswith("{"):
                    return json.loads(line)
            time.sleep(0.05)
        return None

    def start(self):
        for name in self.names:
            self.start_element(name)
        for name in self.link_ports:
            self.start_link(name)
        self.start_host()

    def start_host(self, recovery_rate=None):
        cmd = [BIN, "host", "--nbd", f"127.0.0.1:{self.nbd_port}", "--admin",
               f"127.0.0.1:{self.admin_port}", "--quorum", str(self.quorum),
               "--volume", f"vol0:{self.volume}", "--write-queue", self.write_queue]
        for name in self.names:
            port = self.link_ports.get(name, self.element_ports[name])
            cmd += ["--element", f"{name}=127.0.0.1:{port}"]
        if recovery_rate:
            cmd += ["--recovery-rate", recovery_rate]
        self.host = Proc(cmd, os.path.join(self.work, "host.log"))
        wait_port(self.nbd_port)
        self.wait(lambda st: all(e["state"] == "in-sync" for e in st["elements"]) and
                  all(v["mode"] == "read-write" for v in st["volumes"]), 60, "all in sync")

    def stop_host(self):
        self.host.stop()
        self.host = None

    def status(self):
        out = subprocess.run([BIN, "status", "--admin", f"127.0.0.1:{self.admin_port}", "--json"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return None
        return json.loads(out.stdout)

    def element(self, status, name):
        return next(e for e in status["elements"] if e["name"] == name)

    def wait(self, predicate, timeout, what):
        deadline = time.time() + timeout
        status = None
        while time.time() < deadline:
            if self.host and not self.host.alive():
                raise RuntimeError(f"{self.tag}: host element exited while waiting for {what}")
            status = self.status()
            if status and predicate(status):
                return status
            time.sleep(POLL_SECONDS)
        raise RuntimeError(f"{self.tag}: timed out after {timeout}s waiting for {what}; "
                           f"last status {json.dumps(status)}")

    def kill_element(self, name):
        """kill -9, then wait until the host element has noticed."""
        self.elements[name].kill9()
        self.wait(lambda st: self.element(st, name)["state"] != "in-sync", 20,
                  f"{name} to leave in-sync")

    def wipe(self, name):
        shutil.rmtree(self.data_dir(name))

    def stop(self):
        procs = ([self.host] if self.host else []) + list(self.links.values()) + \
            list(self.elements.values())
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(timeout=10)
            if not p.log.closed:
                p.log.close()

    def dump_logs(self):
        for log in sorted(os.listdir(self.work)):
            if not log.endswith(".log"):
                continue
            print(f"--- {self.tag}/{log} (warnings and errors)", file=sys.stderr)
            with open(os.path.join(self.work, log), errors="replace") as f:
                for line in f:
                    if any(w in line for w in ("WARN", "ERROR", "error", "panick")):
                        print(line.rstrip()[:400], file=sys.stderr)


def watch_recovery(cluster, name, previous_last, timeout):
    """Polls status from now until `name` is in sync again after a recovery; returns what was
    seen: wall seconds, kinds and phases in order, copy progress, the host's last_recovery."""
    started = time.monotonic()
    seen = {"kinds": [], "phases": [], "first_recovering_s": None, "copied_bytes_max": 0,
            "total_bytes": None, "copy_seconds": None, "samples": 0, "timeline": []}
    while True:
        if not cluster.host.alive():
            raise RuntimeError(f"{cluster.tag}: host element exited during recovery of {name}")
        status = cluster.status()
        now = time.monotonic() - started
        if status:
            seen["samples"] += 1
            e = cluster.element(status, name)
            r = e.get("recovery")
            if e["state"] == "recovering" and r:
                seen["timeline"].append([round(now, 3), r["kind"], r.get("phase"), r.get("source"),
                                         r.get("done_records"), r.get("total_records"),
                                         r.get("done_bytes"), r.get("copied_bytes")])
                if seen["first_recovering_s"] is None:
                    seen["first_recovering_s"] = now
                if not seen["kinds"] or seen["kinds"][-1] != r["kind"]:
                    seen["kinds"].append(r["kind"])
                if not seen["phases"] or seen["phases"][-1] != r.get("phase"):
                    seen["phases"].append(r.get("phase"))
                if r.get("phase") == "copy":
                    seen["copied_bytes_max"] = max(seen["copied_bytes_max"], r.get("copied_bytes", 0))
                    seen["total_bytes"] = r.get("total_bytes")
                    seen["copy_seconds"] = r.get("seconds")
            last = e.get("last_recovery")
            if e["state"] == "in-sync" and (seen["first_recovering_s"] is not None or
                                            last != previous_last):
                seen["wall_seconds"] = now
                seen["last_recovery"] = last
                return seen
        if now > timeout:
            raise RuntimeError(f"{cluster.tag}: {name} not in sync {timeout}s after restart "
                               f"(seen {seen}); last status {json.dumps(status)}")
        time.sleep(POLL_SECONDS)


def last_recovery_of(cluster, name):
    return cluster.element(cluster.status(), name).get("last_recovery")


def fio_cmd(uri, name, rw, bs, iodepth, size, offset=0, runtime=None, rate=None):
    cmd = ["fio", "--name=" + name, "--ioengine=nbd", "--uri=" + uri, f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={iodepth}", "--numjobs=1", f"--size={fio_size(size)}",
           f"--offset={fio_size(offset)}", "--output-format=json", "--randrepeat=0"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    if rate:
        cmd += [f"--rate={rate}"]
    return cmd


def fio_result(out, what):
    if out.returncode != 0:
        raise RuntimeError(f"fio {what} failed: {out.stderr[-2000:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    w = job["write"]
    return {"iops": w["iops"], "mb_s": w["bw_bytes"] / 1e6, "bytes": w["io_bytes"],
            "seconds": job["elapsed"], "lat_mean_us": w["lat_ns"]["mean"] / 1e3,
            "errors": job.get("error", 0)}


def fio_write(uri, size, offset=0, bs="1M", iodepth=8):
    """Writes `size` bytes sequentially at `offset`; returns fio's figures."""
    out = subprocess.run(fio_cmd(uri, "write", "write", bs, iodepth, size, offset),
                         capture_output=True, text=True, timeout=600)
    return fio_result(out, "write")


def fio_randwrite(uri, size, runtime, iodepth=16):
    out = subprocess.run(fio_cmd(uri, "randwrite", "randwrite", "4k", iodepth, size,
                                 runtime=runtime),
                         capture_output=True, text=True, timeout=runtime + 120)
    return fio_result(out, "randwrite")


def cpu_idle_sampler():
    """Returns stop() -> mean fraction of CPU time busy since the call (from /proc/stat)."""
    def read():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]
    total0, idle0 = read()

    def stop():
        total1, idle1 = read()
        return 1 - (idle1 - idle0) / max(1, total1 - total0)
    return stop


# ---------------------------------------------------------------------------------------------
# The measurements


def full_recovery(cluster, name, timeout, wipe=True, gap_bytes=0, gap_offset=0):
    """Kills `name`; wipes it (or writes `gap_bytes` while it is down); restarts; watches."""
    previous = last_recovery_of(cluster, name)
    cluster.kill_element(name)
    gap = None
    if wipe:
        cluster.wipe(name)
    if gap_bytes:
        gap = fio_write(cluster.uri, gap_bytes, gap_offset)
    cluster.start_element(name)
    seen = watch_recovery(cluster, name, previous, timeout)
    seen["gap_write"] = gap
    return seen


def replay_recovery(cluster, name, gap_bytes, gap_offset, timeout, link=None):
    previous = last_recovery_of(cluster, name)
    cluster.kill_element(name)
    gap = fio_write(cluster.uri, gap_bytes, gap_offset)
    if link:
        link()
    cluster.start_element(name)
    seen = watch_recovery(cluster, name, previous, timeout)
    seen["gap_write"] = gap
    return seen


def link_bytes(before, after):
    """Payload bytes the link carried from the source element's side (b) to its clients."""
    if not before or not after:
        return None
    return after["b_to_a"]["bytes_delivered"] - before["b_to_a"]["bytes_delivered"]


def steady_rate(timeline, data_bytes):
    """From the status samples: the rate while bytes were moving (copy: copied bytes from the
    first sample with some to the first with all of them; replay: records done, at the data
    set's mean record size), and the copy's tail spent scanning never-written regions."""
    copy = [t for t in timeline if t[2] == "copy" and t[7]]
    if len(copy) >= 2:
        top = max(t[7] for t in copy)
        end = next(t for t in copy if t[7] == top)
        if end[0] > copy[0][0]:
            return {"steady_mb_s": (top - copy[0][7]) / (end[0] - copy[0][0]) / 1e6,
                    "steady_window_s": end[0] - copy[0][0],
                    "hole_scan_s": timeline[-1][0] - end[0]}
    replay = [t for t in timeline if t[2] == "replay" and t[4] is not None and t[5]]
    moving = [t for t in replay if t[4] > 0]
    if len(moving) >= 2 and moving[-1][0] > moving[0][0]:
        per_record = data_bytes / max(moving[-1][5], 1)
        return {"steady_mb_s": (moving[-1][4] - moving[0][4]) * per_record /
                (moving[-1][0] - moving[0][0]) / 1e6,
                "steady_window_s": moving[-1][0] - moving[0][0]}
    return {}


def recovery_rates(seen, data_bytes):
    """Rates over the host element's own recovery seconds (start to in-sync, copy and catch-up
    together: conservative) and over the wall time from the restart."""
    last = seen["last_recovery"] or {}
    secs = last.get("seconds") or seen["wall_seconds"]
    copied = last.get("copied_bytes") or seen["copied_bytes_max"]
    out = {"kind": last.get("kind"), "kinds_seen": seen["kinds"], "phases_seen": seen["phases"],
           "seconds": secs, "wall_seconds": seen["wall_seconds"],
           "first_recovering_s": seen["first_recovering_s"], "records": last.get("records"),
           "copied_bytes": copied, "data_bytes": data_bytes,
           "total_bytes": seen["total_bytes"], "copy_seconds_last_seen": seen["copy_seconds"],
           "timeline": seen["timeline"]}
    out.update(steady_rate(seen["timeline"], data_bytes))
    if "copy" in seen["phases"] or "full" in seen["kinds"] or last.get("kind") == "full":
        out["copy_mb_s"] = copied / secs / 1e6
        out["scan_mb_s"] = (seen["total_bytes"] or 0) / secs / 1e6
        out["replay_mb_s"] = 0.0
    else:
        out["replay_mb_s"] = data_bytes / secs / 1e6
    return out


class Churn(threading.Thread):
    """Keeps `name` in full recovery: each time it is in sync, kill -9, wipe, restart."""

    def __init__(self, cluster, name):
        super().__init__(daemon=True)
        self.cluster, self.name = cluster, name
        self.stop_event = threading.Event()
        self.recoveries = 0
        self.samples = {"recovering": 0, "other": 0}
        self.error = None
        self.kinds = set()

    def run(self):
        try:
            while not self.stop_event.is_set():
                self.cluster.kill_element(self.name)
                self.cluster.wipe(self.name)
                self.cluster.start_element(self.name)
                while not self.stop_event.is_set():
                    st = self.cluster.status()
                    if st:
                        e = self.cluster.element(st, self.name)
                        if e["state"] == "recovering":
                            self.samples["recovering"] += 1
                            self.kinds.add(e["recovery"]["kind"])
                        else:
                            self.samples["other"] += 1
                        if e["state"] == "in-sync":
                            self.recoveries += 1
                            break
                        if not self.cluster.host.alive():
                            raise RuntimeError("host element exited")
                    time.sleep(POLL_SECONDS)
        except Exception as e:  # reported by the caller
            self.error = repr(e)

    def finish(self):
        self.stop_event.set()
        self.join(timeout=60)

    def in_recovery_fraction(self):
        total = self.samples["recovering"] + self.samples["other"]
        return self.samples["recovering"] / total if total else 0.0


def foreground_during_recovery(cluster, name, size, runtime, rate_limit, rounds):
    """fio 4 KiB random writes QD16 without recovery and with `name` continuously in full
    recovery, unpaced and paced (host element restarted with --recovery-rate)."""
    runs = []
    host_label = ["unpaced"]

    def measure(label, churn):
        cpu = cpu_idle_sampler()
        c = None
        if churn:
            c = Churn(cluster, name)
            c.start()
            time.sleep(0.5)  # the first kill and restart happen before fio starts
        r = fio_randwrite(cluster.uri, size, runtime)
        r["cpu_busy"] = cpu()
        r["label"] = label
        r["host"] = host_label[0]
        if c:
            c.finish()
            r["recoveries_finished"] = c.recoveries
            r["in_recovery_fraction"] = c.in_recovery_fraction()
            r["recovery_kinds"] = sorted(c.kinds)
            if c.error:
                r["churn_error"] = c.error
            cluster.wait(lambda st: cluster.element(st, name)["state"] == "in-sync", 300,
                         f"{name} in sync after the churn")
        runs.append(r)

    for _ in range(rounds):
        measure("no recovery", False)
        measure("full recovery, unpaced", True)
    cluster.stop_host()
    cluster.start_host(recovery_rate=rate_limit)
    host_label[0] = f"--recovery-rate {rate_limit}"
    for _ in range(rounds):
        measure(f"full recovery, --recovery-rate {rate_limit}", True)
        measure("no recovery", False)
    cluster.stop_host()
    cluster.start_host()
    return runs


def outage_fraction(cluster, name, outage_s, rate, size, warm_s=5):
    """A steady rate-limited 4 KiB random-write load; `name` down for `outage_s` in the middle;
    recovery time after the restart / outage."""
    runtime = warm_s + outage_s + max(30, 2 * outage_s)
    fio = subprocess.Popen(fio_cmd(cluster.uri, "steady", "randwrite", "4k", 4, size,
                                   runtime=runtime, rate=rate),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(warm_s)
        previous = last_recovery_of(cluster, name)
        down_at = time.monotonic()
        cluster.kill_element(name)
        time.sleep(max(0.0, outage_s - (time.monotonic() - down_at)))
        outage = time.monotonic() - down_at
        cluster.start_element(name)
        seen = watch_recovery(cluster, name, previous, runtime)
    finally:
        fio.send_signal(signal.SIGINT)
        try:
            stdout, stderr = fio.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            fio.kill()
            stdout, stderr = fio.communicate()
    load = None
    try:
        load = fio_result(subprocess.CompletedProcess([], 0, stdout, stderr), "steady")
    except (ValueError, RuntimeError, KeyError):
        pass
    last = seen["last_recovery"] or {}
    return {"outage_s": outage, "load_rate": rate, "load": load, "kind": last.get("kind"),
            "kinds_seen": seen["kinds"], "records": last.get("records"),
            "host_recovery_s": last.get("seconds"), "wall_s": seen["wall_seconds"],
            "first_recovering_s": seen["first_recovering_s"],
            "fraction_host": (last.get("seconds") or 0) / outage,
            "fraction_wall": seen["wall_seconds"] / outage}


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="reduced sizes, about 2 minutes")
    ap.add_argument("--json")
    ap.add_argument("--delay-ms", type=float, default=65.0)
    ap.add_argument("--rate-mbit", type=float, default=124.0)
    ap.add_argument("--outage", type=float, help="seconds down in the outage run")
    ap.add_argument("--load-rate", help="fio --rate of the outage run's load (e.g. 4m)")
    ap.add_argument("--recovery-rate", default="32MiB")
    ap.add_argument("--report", metavar="JSON", help="only print the tables of a saved --json")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        args.delay_ms, args.rate_mbit = saved["link"]["delay_ms"], saved["link"]["rate_mbit"]
        report(saved, args.rate_mbit / 8, args)
        return
    if args.quick:
        # The write queue's floor is one maximal write (32 MiB + overhead). A wiped element
        # recovers by replay while a peer's replay log still reaches back to sequence 1, so the
        # data sets of the full recoveries exceed the replay logs (plus one 64 MiB log segment).
        # Replay logs keep whole 64 MiB segments: closed ones up to the budget, so a gap is
        # covered for sure only up to the budget less one segment.
        p = dict(volume="512MiB", data=256 * MiB, write_queue="40MiB", replay_log="160MiB",
                 replay=64 * MiB, small_log_gap=96 * MiB, wan_write_queue="40MiB",
                 wan_replay_log="160MiB", wan_data=256 * MiB, wan_replay=80 * MiB, runtime=4,
                 outage=8.0, load_rate="8m", rounds=1)
    else:
        p = dict(volume="2GiB", data=512 * MiB, write_queue="64MiB", replay_log="256MiB",
                 replay=160 * MiB, small_log_gap=128 * MiB, wan_write_queue="40MiB",
                 wan_replay_log="256MiB", wan_data=384 * MiB, wan_replay=160 * MiB, runtime=10,
                 outage=20.0, load_rate="4m", rounds=2)
    if args.outage:
        p["outage"] = args.outage
    if args.load_rate:
        p["load_rate"] = args.load_rate
    volume_bytes = mib(p["volume"])
    link_mb_s = args.rate_mbit / 8
    work = tempfile.mkdtemp(prefix="starfish-rbench-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    results = {"params": {k: v for k, v in p.items()}, "link": {"delay_ms": args.delay_ms,
               "rate_mbit": args.rate_mbit}, "started": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                       time.gmtime())}
    clusters = []
    load0 = os.getloadavg()
    try:
        # Loopback, N=3, Q=2, default replay log (256 MiB); "far" is the element that recovers.
        a = Cluster(work, "loopback", ["local", "near", "far"], 2, p["volume"], p["write_queue"],
                    replay_log=p["replay_log"])
        clusters.append(a)
        a.start()
        results["fill"] = fio_write(a.uri, p["data"])
        results["replay_loopback"] = recovery_rates(
            replay_recovery(a, "far", p["replay"], volume_bytes // 2, 300), p["replay"])
        # The volume now holds the data set and the replay gap (at another offset).
        results["full_loopback"] = recovery_rates(full_recovery(a, "far", 600),
                                                  p["data"] + p["replay"])
        results["outage"] = outage_fraction(a, "far", p["outage"], p["load_rate"], p["data"])
        results["foreground"] = foreground_during_recovery(
            a, "far", p["data"], p["runtime"], args.recovery_rate, p["rounds"])
        a.stop()
        clusters.remove(a)
        shutil.rmtree(a.work, ignore_errors=True)

        # Loopback, small replay logs: a brief outage whose gap no replay log covers.
        b = Cluster(work, "smalllog", ["local", "near", "far"], 2, p["volume"], p["write_queue"],
                    replay_log="32MiB")
        clusters.append(b)
        b.start()
        fio_write(b.uri, p["data"])
        results["full_small_log"] = recovery_rates(
            full_recovery(b, "far", 600, wipe=False, gap_bytes=p["small_log_gap"],
                          gap_offset=p["data"] // 4), p["data"])
        results["full_small_log"]["gap_bytes"] = p["small_log_gap"]
        b.stop()
        clusters.remove(b)
        shutil.rmtree(b.work, ignore_errors=True)

        # Far link: N=2, Q=1; "far" (the source) behind the link proxy, "local" (target) direct.
        # A small write queue: the replay gap is pulled over the link, not streamed from the queue.
        c = Cluster(work, "wan", ["local", "far"], 1, p["volume"], p["wan_write_queue"],
                    replay_log=p["wan_replay_log"], linked=["far"])
        clusters.append(c)
        c.start()
        fio_write(c.uri, p["wan_data"])

        def slow():
            c.set_link("far", args.delay_ms, args.rate_mbit)

        def fast():
            c.set_link("far", 0, None)

        # Full: wipe local, slow the link, restart.
        previous = last_recovery_of(c, "local")
        c.kill_element("local")
        c.wipe("local")
        slow()
        stats0 = c.link_stats("far")
        c.start_element("local")
        seen = watch_recovery(c, "local", previous, 900)
        stats1 = c.link_stats("far")
        results["full_wan"] = recovery_rates(seen, p["wan_data"])
        results["full_wan"]["link_bytes"] = link_bytes(stats0, stats1)
        fast()
        stats = {}

        def slow_and_count():
            slow()
            stats["before"] = c.link_stats("far")

        results["replay_wan"] = recovery_rates(
            replay_recovery(c, "local", p["wan_replay"], volume_bytes // 2, 900,
                            link=slow_and_count), p["wan_replay"])
        results["replay_wan"]["link_bytes"] = link_bytes(stats["before"], c.link_stats("far"))
        c.stop()
        clusters.remove(c)
    except Exception:
        for cl in clusters:
            cl.dump_logs()
        raise
    finally:
        for cl in clusters:
            cl.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["loadavg_before"] = load0
    results["loadavg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    report(results, link_mb_s, args)


def report(r, link_mb_s, args):
    p = r["params"]
    M = lambda b: f"{b / MiB:.0f} MiB"  # noqa: E731
    print(f"run {r['started']}, load average before {r['loadavg_before'][0]:.1f}, "
          f"after {r['loadavg_after'][0]:.1f}; volume {p['volume']}, write queue "
          f"{p['write_queue']}\n")
    print("| measurement | what | kind | time s (host / wall) | rate | target | paper |")
    print("|---|---|---|---|---|---|---|")

    def row(label, what, x, rate, target, paper):
        print(f"| {label} | {what} | {'→'.join(x['kinds_seen']) or x['kind']} | "
              f"{x['seconds']:.2f} / {x['wall_seconds']:.2f} | {rate} | {target} | {paper} |")

    def rate(x, link=False):
        if "copy_mb_s" in x:
            text = f"{x['copy_mb_s']:.1f} MB/s copied, {x['scan_mb_s']:.0f} MB/s of volume scanned"
            useful = x["copy_mb_s"]
        else:
            text = f"{x['replay_mb_s']:.1f} MB/s replayed"
            useful = x["replay_mb_s"]
        if x.get("steady_mb_s"):
            text += f" (while moving: {x['steady_mb_s']:.1f} MB/s over {x['steady_window_s']:.1f} s"
            if x.get("hole_scan_s") is not None:
                text += f", then {x['hole_scan_s']:.1f} s skipping unwritten regions"
            text += ")"
        if link:
            text += f" = {useful / link_mb_s:.0%} of the link rate"
            if x.get("link_bytes"):
                used = x["link_bytes"] / x["seconds"] / 1e6
                text += (f"; the link carried {x['link_bytes'] / 1e6:.0f} MB = {used:.1f} MB/s "
                         f"= **{used / link_mb_s:.0%}** of its rate")
        return text

    x = r["full_loopback"]
    row("full, loopback, wiped element", f"{M(x['data_bytes'])} written of {p['volume']}, "
        f"wiped; copied {M(x['copied_bytes'])}", x, rate(x), "—", "7.99–10.12 MB/s")
    x = r["full_small_log"]
    row(f"full, loopback, brief outage > {p.get('small_replay_log', '32MiB')} replay log",
        f"{M(x['gap_bytes'])} written while down, over {M(x['data_bytes'])}; copied "
        f"{M(x['copied_bytes'])}", x, rate(x), "only differing blocks", "whole volume")
    x = r["replay_loopback"]
    row("replay, loopback", f"{M(x['data_bytes'])} written while down ({x['records']} records)",
        x, rate(x), "—", "7.53–9.89 MB/s")
    x = r["full_wan"]
    row(f"full, far link {args.rate_mbit:g} Mbit/s {args.delay_ms:g} ms",
        f"{M(x['data_bytes'])} written of {p['volume']}, wiped; copied {M(x['copied_bytes'])}",
        x, rate(x, True), "≥ 90 %", "3.9 MB/s (25 %)")
    x = r["replay_wan"]
    row(f"replay, far link {args.rate_mbit:g} Mbit/s {args.delay_ms:g} ms",
        f"{M(x['data_bytes'])} written while down ({x['records']} records; write queue "
        f"{p['wan_write_queue']})", x, rate(x, True), "≥ 90 %", "3.9 MB/s (25 %)")
    o = r["outage"]
    print(f"| replay time / outage | {o['outage_s']:.1f} s down under fio randwrite 4k "
          f"--rate={o['load_rate']} ({o['records']} records) | {'→'.join(o['kinds_seen']) or o['kind']} | "
          f"{o['host_recovery_s']:.2f} / {o['wall_s']:.2f} | **{o['fraction_host']:.1%}** "
          f"(restart→in-sync: {o['fraction_wall']:.1%}) | ≤ 10 % | 17 % |")
    print()
    runs = r["foreground"]
    print(f"Foreground: fio 4 KiB randwrite QD16 over the written {M(p['data'])}, "
          f"{p['runtime']} s per run; ratio against the mean of the no-recovery runs of the same "
          f"host element process. Target ≥ 90 %, paper 74–98 %.\n")
    print("| host element | run | IOPS | MB/s | mean µs | ratio | recoveries finished | time in recovery | CPU busy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in runs:
        base = [y["iops"] for y in runs if y["label"] == "no recovery" and
                y.get("host") == x.get("host")]
        base_iops = sum(base) / len(base)
        rec = x.get("recoveries_finished", "—")
        frac = f"{x['in_recovery_fraction']:.0%}" if "in_recovery_fraction" in x else "—"
        err = f" ({x['churn_error']})" if x.get("churn_error") else ""
        print(f"| {x.get('host')} | {x['label']}{err} | {x['iops']:.0f} | {x['mb_s']:.1f} | "
              f"{x['lat_mean_us']:.0f} | {x['iops'] / base_iops:.0%} | {rec} | {frac} | "
              f"{x['cpu_busy']:.0%} |")

if __name__ == "__main__":
    sys.exit(main())
