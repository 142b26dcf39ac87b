"""The real-process counterpart of the simulator (issue 6): a bounded fault
test on real processes whose client history is judged by the simulator's own
checker.

Three elements (local direct; near and far behind `starfish link` proxies), a
host element with Q=2, one small volume. Three NBD connections (a few requests
in flight each) send writes of self-describing sectors (the simulator's
format), trims, write-zeroes, reads, flushes and block status, every request
recorded with its send and answer times (tests/history_recorder.py), while a
fault thread injects, one after the other (and the whole schedule twice):

  1. kill -9 of an element, restarted on its data directory;
  2. the link to another element cut (bytes held) past the heartbeat timeout,
     then healed;
  3. an element killed, restarted, killed again (kill -9) while the status
     shows it recovering (its link slowed meanwhile so that the recovery
     lasts), and restarted;
  4. two elements killed at once (below quorum: read-only, writes fail), both
     restarted.

Then every element is back in sync, the whole volume is read back (recorded as
final reads), and `sim check-history` judges the history with the simulator's
`Model` (stale reads, lost acknowledged writes, garbage, torn reads, flush
order, holes over data). The cluster is stopped and `element verify` must give
identical digests on the three elements.

STARFISH_FAULT_SEED sets the workload seed (random otherwise, printed);
SIM_BIN the checker (default: `sim` next to STARFISH_BIN, else
target/release/sim). A failing history is kept under /tmp with the command
that re-checks it.
"""

import json
import os
import random
import shutil
import signal
import threading
import time

import pytest

import harness
from harness import element_of
import history_recorder

VOLUME_BYTES = 4 * harness.MiB
WORKERS = 3
DEPTH = 4
LINKED = ("near", "far")
ROUNDS = 2  # the fault schedule, twice
STATUS_POLL = 0.02


def sim_bin():
    path = os.environ.get("SIM_BIN")
    if path:
        return path
    if os.environ.get("STARFISH_BIN"):
        return os.path.join(os.path.dirname(os.environ["STARFISH_BIN"]), "sim")
    return os.path.join(harness.REPO, "target", "release", "sim")


class Faults:
    """The fault schedule, run in its own thread; `log` says what happened
    when (seconds since the start)."""

    def __init__(self, cluster, history):
        self.cluster = cluster
        self.history = history
        self.started = time.monotonic()
        self.log = []
        self.injected = {}
        self.error = None
        self.recovering_seen = None

    def note(self, text):
        self.log.append(f"{time.monotonic() - self.started:6.2f}s {text}")

    def count(self, kind):
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def wait_acks(self, more, timeout=30):
        """Lets the workload make progress: `more` write-likes acknowledged."""
        target = self.history.counts()[1] + more
        harness.wait_until(lambda: self.history.counts()[1] >= target, timeout, f"{more} more acknowledged writes")

    def wait_in_sync(self, what, timeout=60):
        self.cluster.wait_status(harness.healthy, timeout, f"all elements in sync after {what}")
        self.note(f"all in sync after {what}")

    def kill(self, name):
        self.cluster.kill_element(name, signal.SIGKILL)
        self.note(f"kill -9 {name}")

    def restart(self, name):
        self.cluster.restart_element(name)
        self.note(f"restarted {name}")

    def run(self):
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = f"{type(e).__name__}: {e}"
            self.note(f"fault thread stopped: {self.error}")

    def _run(self):
        for round_ in range(ROUNDS):
            self.note(f"round {round_ + 1}")
            self.one_round()
        self.note("faults done")

    def one_round(self):
        c = self.cluster
        self.wait_acks(100)

        # 1. kill -9 of an element under load, restarted.
        self.kill("local")
        self.count("element_kill")
        self.wait_acks(100)
        self.restart("local")
        self.wait_in_sync("local's restart")
        self.wait_acks(100)

        # 2. The link to near cut past the heartbeat timeout (3 s), then healed.
        c.proxies["near"].command("cut")
        self.note("link to near cut")
        self.count("link_cut")
        c.wait_status(lambda s: element_of(s, "near")["state"] != "in-sync", 30, "near not in sync while cut")
        self.note("near out of sync")
        self.wait_acks(100)
        time.sleep(1.0)
        c.proxies["near"].command("heal")
        self.note("link to near healed")
        self.wait_in_sync("the heal", timeout=30)
        self.wait_acks(100)

        # 3. far killed, restarted, and killed again while it recovers. Its link is slowed
        #    meanwhile so that catching up takes a while.
        for attempt in range(3):
            self.kill("far")
            self.count("element_kill")
            self.wait_acks(150 * (attempt + 1))
            c.proxies["far"].command("set --rate-mbit 1")
            self.restart("far")
            seen = None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                status = c.fast_status()
                far = element_of(status, "far")
                if far["state"] == "recovering":
                    seen = far.get("recovery") or {"state": "recovering"}
                    break
                if far["state"] == "in-sync" and "last_recovery" in far:
                    break
                time.sleep(STATUS_POLL)
            if seen is not None:
                self.kill("far")
                c.proxies["far"].command("set --rate-mbit none")
                self.count("restart_during_recovery")
                self.recovering_seen = seen
                self.note(f"far killed while recovering: {seen}")
                self.wait_acks(50)
                self.restart("far")
                self.wait_in_sync("far's restart after a kill during recovery")
                break
            c.proxies["far"].command("set --rate-mbit none")
            self.note(f"far not seen recovering (attempt {attempt + 1})")
            self.wait_in_sync("far's restart")
        self.wait_acks(100)

        # 4. Two elements at once: below the quorum, the volume is read-only for a while.
        self.kill("local")
        self.kill("near")
        self.count("two_elements_kill")
        c.wait_status(lambda s: harness.volume_status(s)["mode"] == "read-only", 30, "read-only with one element")
        self.note("volume read-only")
        time.sleep(1.0)
        self.restart("local")
        self.restart("near")
        self.wait_in_sync("local's and near's restart")
        self.wait_acks(100)


@pytest.fixture
def linked_cluster(make_linked_cluster):
    links = {name: (delay_ms, None) for delay_ms, name in zip((1, 2), LINKED)}
    return make_linked_cluster(links, volumes=(("vol0", str(VOLUME_BYTES)),))


def keep_failed_history(path):
    """Copies a history that failed (or could not be checked) out of the
    test's directory, which is removed."""
    kept = f"/tmp/starfish-fault-history-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    os.makedirs(kept, exist_ok=True)
    for suffix in ("", ".data", ".faults"):
        if os.path.exists(path + suffix):
            shutil.copy(path + suffix, kept)
    return os.path.join(kept, os.path.basename(path))


def damage_final_read_back(path):
    """A copy of the data file in which the first final read (the first 256
    KiB of the volume as read back) is zeroes: returns its path."""
    with open(path) as f:
        first_final = next(line.split() for line in f if line.rstrip().endswith(" final"))
    at = int(next(w for w in first_final if w.startswith("data="))[5:])
    length = int(first_final[5])
    mutated = path + ".damaged"
    shutil.copy(path + ".data", mutated)
    with open(mutated, "r+b") as f:
        f.seek(at)
        f.write(bytes(length))
    return mutated


def test_sector_format_matches_the_simulator():
    """The recorder's sectors are the simulator's, byte for byte (the same
    golden value as crates/sim/src/history.rs)."""
    data = history_recorder.sector_bytes(7, 0, 3)
    assert len(data) == 512
    # Not the crc32c of all 512 bytes: data followed by its own crc32c always
    # has the same one (the CRC's residue), whatever the data.
    assert history_recorder.crc32c(data[:508]) == 0x9F3F_A95D
    assert data[508:] == (0x9F3F_A95D).to_bytes(4, "little")
    assert history_recorder.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


@pytest.mark.time_limit(180)
def test_fault_history_checked_by_the_simulator(linked_cluster, workdir):
    checker = sim_bin()
    if not os.access(checker, os.X_OK):
        pytest.fail(f"the simulator's checker is not at {checker}: run `cargo build --release -p sim` "
                    "or set SIM_BIN", pytrace=False)
    cluster = linked_cluster
    seed = int(os.environ.get("STARFISH_FAULT_SEED") or random.randrange(1 << 32))
    print(f"workload seed {seed} (STARFISH_FAULT_SEED={seed} repeats the workload; fault timing is real)")
    path = os.path.join(workdir, "history.txt")
    history = history_recorder.History(path, VOLUME_BYTES)
    stop = threading.Event()
    workers = [history_recorder.Worker(history, cluster.uri(), seed * 16 + i, stop, depth=DEPTH)
               for i in range(WORKERS)]
    faults = Faults(cluster, history)
    fault_thread = threading.Thread(target=faults.run, name="faults", daemon=True)
    started = time.monotonic()
    try:
        for w in workers:
            w.start()
        fault_thread.start()
        fault_thread.join(110)
        assert not fault_thread.is_alive(), "fault schedule still running after 110 s:\n" + "\n".join(faults.log)
        time.sleep(1.0)
    finally:
        stop.set()
        deadline = time.monotonic() + 70  # a worker drains for at most 60 s
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
    workload_seconds = time.monotonic() - started
    with open(path + ".faults", "w") as f:
        f.write("\n".join(faults.log) + "\n")
    stuck = [w.name for w in workers if w.is_alive()]
    assert not stuck, f"workers did not stop: {stuck}"
    assert faults.error is None, f"fault schedule failed: {faults.error}\n" + "\n".join(faults.log)
    errors = [f"{w.name}: {w.error}" for w in workers if w.error]
    assert not errors, errors

    status = cluster.wait_caught_up()
    acked_sequence = harness.volume_status(status)["acked_sequence"]
    history_recorder.read_back(history, cluster.uri(), VOLUME_BYTES)
    history.save()
    history.close()

    result = harness.run([checker, "check-history", path, "--json"], timeout=120, check=False)
    if result.returncode not in (0, 1):
        kept = keep_failed_history(path)
        raise AssertionError(f"check-history could not judge the history (exit {result.returncode}), "
                             f"kept at {kept}:\n{result.stderr}")
    report = json.loads(result.stdout)
    figures = (
        f"{workload_seconds:.0f} s of workload, {report['ops']} requests recorded "
        f"({report['writes_acked']} writes acknowledged, failed {report['writes_failed']}, "
        f"{report['reads_checked']} reads / {report['sectors_checked']} sectors checked, "
        f"{report['flushes']} flushes (not judged), {report['block_status_checked']} block status, "
        f"{report['unanswered']} unanswered); faults {faults.injected}; "
        f"recovery seen when killed: {faults.recovering_seen}; "
        f"reconnections {sum(w.connections for w in workers) - WORKERS}; "
        f"overlapping write-likes not sent {sum(w.overlaps_skipped for w in workers)}; "
        f"violations {report['violations']}, acknowledged writes lost {report['acked_writes_lost']}"
    )
    print(figures)
    print("\n".join(faults.log))
    if report["violations"]:
        kept = keep_failed_history(path)
        shown = "\n  ".join(report["violation_messages"][:20])
        raise AssertionError(
            f"the simulator's checker found {report['violations']} violation(s) in the recorded history "
            f"(seed {seed}); kept at {kept}, re-check with: {checker} check-history {kept}\n  {shown}\n"
            f"{figures}\nfaults:\n" + "\n".join(faults.log)
        )
    # The checker is not blind on this path: the same history with the final read-back of the
    # first 256 KiB zeroed must be caught (acknowledged writes lost, stale reads).
    mutated = damage_final_read_back(path)
    result = harness.run([checker, "check-history", path, "--data", mutated, "--json"], timeout=120, check=False)
    caught = json.loads(result.stdout) if result.returncode in (0, 1) else {}
    assert result.returncode == 1 and caught.get("acked_writes_lost", 0) > 0, (
        f"the checker missed lost writes in a damaged copy of the history (exit {result.returncode}): "
        f"{result.stdout[:2000]}{result.stderr[:2000]}"
    )
    print(f"damaged copy: {caught['violations']} violations, {caught['acked_writes_lost']} acknowledged writes lost")

    assert faults.injected.get("restart_during_recovery") == ROUNDS, (
        f"far was never seen recovering, so no restart during recovery happened:\n" + "\n".join(faults.log)
    )
    assert report["writes_failed"], "the read-only phase refused no write: the fault did not bite"
    assert report["final_sectors_checked"] == VOLUME_BYTES // 512

    # The link emulator held up (it once panicked after a connection died with bytes in flight).
    for name, proxy in cluster.proxies.items():
        assert not proxy.panicked(), f"link proxy to {name} panicked:\n{harness.tail_file(proxy.log_path)}"

    # Replicas byte-identical: stopped cleanly, verified, equal digests.
    complaints = cluster.stop()
    assert not complaints, complaints
    reports = {name: element.verify() for name, element in cluster.elements.items()}
    digests = {name: r["volumes"][0]["digest"] for name, r in reports.items()}
    sequences = {name: r["volumes"][0]["applied_sequence"] for name, r in reports.items()}
    assert len(set(digests.values())) == 1, f"replicas differ: {digests}"
    assert len(set(sequences.values())) == 1 and acked_sequence <= min(sequences.values()), (acked_sequence, sequences)
