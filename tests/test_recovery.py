"""Recovery of an element that comes back, under a continuous verified write
load: quick recovery (its gap is still in the host element's write queue),
replay recovery (the gap left the queue: pulled from an in-sync peer's replay
log, paced by `--recovery-rate`), the replay source killed mid-replay, a host
element restarted while an element is down, and today's limit (a gap no
peer's replay log covers needs full recovery, which is not built: the element
stays failed and says so).

Two writers, on disjoint regions of vol0:
  - "load": small writes (1..4 blocks, 2 in flight) all through the test;
  - "burst": large writes (up to 1 MiB, 4 in flight) while an element is down,
    to push its gap past the write queue.
Every acknowledged write of both is read back at the end; then the cluster is
stopped cleanly, every element's data directory must pass `element verify`
and the digests must be identical (on all three; on the two in sync where an
element is left failed by design).
"""

import errno
import json
import os
import signal
import time
import urllib.request

import pytest

import harness
from browser import Browser
from harness import MiB, Client, LoadWriter, element_of, volume_status, wait_until

REGION_BLOCKS = 16384  # 64 MiB of 4 KiB blocks per writer region
LOAD_OFFSET = 0
BURST_OFFSET = 256 * MiB
LOAD = dict(max_blocks=4, inflight=2)
BURST = dict(max_blocks=256, inflight=4)
SMALL_QUEUE = "40MiB"
# Paced replays must still outrun the foreground load (else they never reach the write queue):
# the load writes about 5..15 MiB/s here (up to 30 with Q=1).
PACED_RATE = "32MiB"  # per second: the ~120 MiB to replay take several seconds
FAST_PACED_RATE = "64MiB"
BIG_REPLAY_LOG = "1GiB"  # paced tests: the peers' replay logs are not what is tested there


# ---------------------------------------------------------------------------
# Helpers


class AckedBytes:
    """Bytes acknowledged so far in an nbd_writer.py log (read incrementally)."""

    def __init__(self, path):
        self.path = path
        self.position = 0
        self.rest = b""
        self.spans = {}
        self.bytes = 0

    def __call__(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.position)
                data = f.read()
                self.position = f.tell()
        except FileNotFoundError:
            return 0
        lines = (self.rest + data).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == b"S":
                self.spans[parts[1]] = int(parts[3])
            elif parts[0] == b"A":
                self.bytes += self.spans.pop(parts[1]) * harness.BLOCK
        return self.bytes


def applied(status, name, volume="vol0"):
    return element_of(status, name)["applied_sequence"][volume]


def start_load(workdir, uri, seed, name="load", first_generation=1):
    return LoadWriter(
        workdir, uri, REGION_BLOCKS, seed, name=name, offset=LOAD_OFFSET, first_generation=first_generation, **LOAD
    )


def write_burst(workdir, uri, megabytes, seed, name="burst", timeout=120):
    """Large writes to the burst region until `megabytes` MiB are acknowledged;
    returns the burst's WriteLog (checked: no write failed)."""
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed, name=name, offset=BURST_OFFSET, **BURST) as burst:
        acked = AckedBytes(burst.log_path)
        wait_until(
            lambda: acked() >= megabytes * MiB or not burst.process.alive(),
            timeout,
            f"{megabytes} MiB of acknowledged burst writes",
        )
        assert burst.process.alive(), f"burst writer exited early:\n{burst.output()}"
        code = burst.finish()
        assert code == 0, f"burst writer exit {code}\n{burst.output()}"
    log = harness.WriteLog(burst.log_path, BURST_OFFSET, REGION_BLOCKS)
    assert log.done
    assert not log.failed, f"burst writes failed: {log.failed[:10]}"
    return log


def load_log(workdir, *writers):
    """The load region's WriteLog, over one or more successive load writers."""
    path = f"{workdir}/load-combined.log"
    with open(path, "w") as out:
        for writer in writers:
            with open(writer.log_path) as f:
                out.write(f.read())
    return harness.WriteLog(path, LOAD_OFFSET, REGION_BLOCKS)


def check_writes(uri, *write_logs):
    """Reads every region back: every acknowledged write is there, nothing torn."""
    with Client(uri) as client:
        for write_log in write_logs:
            problems = harness.check_stamped_region(client, write_log)
            assert not problems, "\n".join(problems)


def verify_all(cluster, workdir, uri, load, *others):
    """After a test: no write of `load` failed, every acknowledged write of it and of
    `others` (WriteLogs) reads back, all three elements catch up, stop cleanly and
    hold identical volumes."""
    log = load_log(workdir, load)
    assert log.done
    assert not log.failed, f"writes failed: {log.failed[:10]}"
    check_writes(uri, log, *others)
    cluster.wait_caught_up()
    stop_and_compare(cluster)


def watch(cluster, predicate, timeout, what, interval=0.1, on_sample=None):
    """Polls status until `predicate(status)`; returns (status, samples) where
    samples are (seconds since start, status, on_sample(status)) in order."""
    samples = []
    started = time.monotonic()
    while True:
        if not cluster.host.alive():
            raise AssertionError(f"host exited with {cluster.host.returncode()}\n--- host log:\n{cluster.host.log()}")
        status = cluster.status()
        extra = on_sample(status) if on_sample else None
        samples.append((time.monotonic() - started, status, extra))
        if predicate(status):
            return status, samples
        if time.monotonic() - started > timeout:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what}\n"
                f"timeline: {timeline(samples)}\nlast status: {json.dumps(status, indent=1)}"
            )
        time.sleep(interval)


def timeline(samples, name=None):
    """Compact history of the elements' states (or one element's) in samples."""
    out, previous = [], None
    for t, status, _ in samples:
        elements = [element_of(status, name)] if name else status["elements"]
        now = tuple(
            (
                e["name"],
                e["state"],
                (e.get("recovery") or {}).get("kind"),
                (e.get("recovery") or {}).get("source"),
                (e.get("reason") or "")[:160],
            )
            for e in elements
        ) + (volume_status(status)["mode"],)
        if now != previous:
            out.append(f"{t:.2f}s {now}")
            previous = now
    return "\n  " + "\n  ".join(out)


def back_in_sync(name):
    return lambda s: element_of(s, name)["state"] == "in-sync" and "last_recovery" in element_of(s, name)


def recovering_samples(samples, name):
    return [(t, element_of(s, name)["recovery"], extra) for t, s, extra in samples
            if element_of(s, name)["state"] == "recovering" and "recovery" in element_of(s, name)]


def stop_and_compare(cluster, identical=harness.ELEMENT_NAMES):
    """Stops the cluster cleanly; every element's data directory verifies clean
    and the `identical` ones hold the same volumes with equal digests."""
    complaints = cluster.stop()
    assert not complaints, complaints
    reports = {name: element.verify() for name, element in cluster.elements.items()}
    for volume, _ in cluster.volumes:
        per_element = {}
        for name in identical:
            found = [v for v in reports[name]["volumes"] if v["name"] == volume]
            assert found, f"{volume} missing on {name}: {reports}"
            per_element[name] = found[0]
        for key in ("digest", "applied_sequence", "size_bytes"):
            values = {name: v[key] for name, v in per_element.items()}
            assert len(set(values.values())) == 1, f"{volume}: replicas differ in {key}: {values}"
    return reports


def make_cluster_with_replay_log(make_cluster, replay_log, **kwargs):
    """A started cluster whose elements run with `--replay-log replay_log`."""
    cluster = make_cluster(start=False, **kwargs)
    for element in cluster.elements.values():
        element.process.args += ["--replay-log", replay_log]
    return cluster.start()


def kill_and_wait_out(cluster, name):
    cluster.kill_element(name, signal.SIGKILL)
    cluster.wait_status(
        lambda s: element_of(s, name)["state"] != "in-sync", 30, f"{name} reported not in-sync after kill -9"
    )


def recovery_attempts(cluster, name):
    """Recoveries of `name` the host element has started, from its log."""
    with open(cluster.host.log_path, errors="replace") as f:
        return sum(1 for line in f if "recovery started" in line and f'"{name}"' in line)


def replay_switches(cluster, name):
    """Replays of `name` that reached the write queue (and went on from it), from the host's log."""
    with open(cluster.host.log_path, errors="replace") as f:
        return sum(1 for line in f if "reached the write queue" in line and f'"{name}"' in line)


def gap_left_the_queue(status, name):
    """The element's applied sequence is older than what the write queue holds."""
    oldest = volume_status(status)["write_queue_oldest_sequence"]
    return oldest is not None and oldest > applied(status, name) + 1


# ---------------------------------------------------------------------------
# Tests


@pytest.mark.time_limit(150)
def test_kill9_element_quick_recovery(cluster, workdir):
    """An element killed and restarted quickly finds its gap in the write
    queue: quick recovery."""
    uri = cluster.uri()
    with start_load(workdir, uri, seed=31) as load:
        load.wait_acks(300)
        kill_and_wait_out(cluster, "near")
        load.wait_acks(500, what="acknowledged writes with near down")
        cluster.restart_element("near")
        status, samples = watch(cluster, back_in_sync("near"), 60, "near back in sync")
        last = element_of(status, "near")["last_recovery"]
        assert last["kind"] == "quick", f"last_recovery {last}; timeline: {timeline(samples, 'near')}"
        assert last["records"] > 0, last
        for _, recovery, _ in recovering_samples(samples, "near"):
            assert recovery["kind"] == "quick", recovery
        assert volume_status(status)["mode"] == "read-write", status
        # The host element's lines about near name it, the epoch and where it stood.
        with open(cluster.host.log_path, errors="replace") as f:
            about_near = [line for line in f if 'element="near"' in line]
        epoch = status["epoch"]
        for what in ("element failed", "recovery started", "element in sync"):
            lines = [line for line in about_near if what in line]
            assert lines and all(f"host{{epoch={epoch}}}" in line and 'applied="vol0@' in line for line in lines), \
                (what, about_near)
        load.wait_acks(300, what="acknowledged writes after near came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    log = load_log(workdir, load)
    assert log.done
    assert not log.failed, f"writes failed with one element down: {log.failed[:10]}"
    check_writes(uri, log)
    cluster.wait_caught_up()
    stop_and_compare(cluster)


@pytest.mark.time_limit(150)
def test_replay_recovery_past_the_write_queue(make_cluster, workdir):
    """With a 40 MiB write queue, 100 MiB written while an element is down
    leave the queue but not the peers' replay logs (256 MiB): the element
    pulls its gap from a peer (replay recovery) and ends in sync."""
    cluster = make_cluster(host_extra=["--write-queue", SMALL_QUEUE])
    uri = cluster.uri()
    with start_load(workdir, uri, seed=41) as load:
        load.wait_acks(300)
        kill_and_wait_out(cluster, "far")
        burst = write_burst(workdir, uri, 100, seed=42)
        status = cluster.status()
        assert gap_left_the_queue(status, "far"), f"setup: far's gap is still in the write queue: {status}"
        cluster.restart_element("far")
        status, samples = watch(cluster, back_in_sync("far"), 90, "far back in sync", interval=0.05)
        last = element_of(status, "far")["last_recovery"]
        recovering = recovering_samples(samples, "far")
        print(f"replay: last_recovery {last}; recovery seen in {len(recovering)} status samples; "
              f"timeline: {timeline(samples, 'far')}")
        assert last["kind"] == "replay", f"last_recovery {last}; timeline: {timeline(samples, 'far')}"
        assert last["records"] >= burst.acked_count, (last, burst.acked_count)
        for _, recovery, _ in recovering:
            assert recovery["kind"] == "replay", recovery
            assert recovery["source"] in ("local", "near"), recovery
            assert 0 <= recovery["done_records"] <= recovery["total_records"], recovery
        assert volume_status(status)["mode"] == "read-write", status
        load.wait_acks(300, what="acknowledged writes after far came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst)


# The status page's element rows ("name:state ..."), and far's row: its state and its recovery
# progress bar ([value, max]) if it shows one.
ELEMENTS_SHOWN = "[...document.querySelectorAll('#elements tr')].map((r) => r.dataset.element + ':' + r.dataset.state).join(' ')"


def far_row():
    return "document.querySelector('#elements tr[data-element=far]')"


FAR_SHOWN = f"""(() => {{
    const row = {far_row()};
    if (!row) return null;
    const bar = row.querySelector('progress.recovery');
    return {{ state: row.dataset.state, progress: bar ? [bar.value, bar.max] : null }};
}})()"""


def scrape(cluster):
    """`GET /metrics`, parsed by the Prometheus client library's OpenMetrics parser (strict:
    names, types, escaping and the closing `# EOF`): {(name, labels): value} of every sample."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{cluster.admin}/metrics", timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("application/openmetrics-text"), answer.headers
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        samples[("family", family.name)] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.mark.time_limit(150)
def test_paced_replay_shows_progress(make_cluster, workdir):
    """`--recovery-rate` paces a replay so that it takes seconds: status shows
    it (kind replay, a peer as source, done_records going up) while foreground
    writes keep being acknowledged. The metrics say so too, scraped and parsed by a
    real Prometheus parser while the replay runs; and so does the live status page in
    headless Chromium, without a reload: far failed, then recovering with a moving
    progress bar, then in sync (screenshots in the test's directory)."""
    cluster = make_cluster_with_replay_log(
        make_cluster, BIG_REPLAY_LOG, host_extra=["--write-queue", SMALL_QUEUE, "--recovery-rate", PACED_RATE]
    )
    uri = cluster.uri()
    with start_load(workdir, uri, seed=51) as load, Browser(workdir) as page:
        page.open(f"http://{cluster.admin}/")
        page.wait(ELEMENTS_SHOWN + " === 'local:in-sync near:in-sync far:in-sync'", 15, "three elements in sync")
        page.wait("document.querySelector('#volumes tr[data-volume=vol0]')?.dataset.mode === 'read-write'", 5, "vol0")
        assert page.eval("document.querySelector('#volumes [data-beginning]') === null"), "durable policies: no wait"
        # A beginning record fewer than Q hold (weaker ack policies only; real elements hold it
        # within milliseconds, so the page's row is rendered from a status of that state).
        row = ("volumeRow({name: 'v', mode: 'read-write', size_bytes: 4096, acked_sequence: 3,"
               " write_queue_used_bytes: 0, write_queue_capacity_bytes: 1, writes_waiting: 0,"
               " beginning: {sequence: 3, held_by: %d, reads_wait: %s, reads_held: 2}})"
               ".querySelector('[data-beginning]').textContent")
        assert page.eval(row % (1, "true")) == "beginning held by 1, 2 reads wait"
        assert page.eval(row % (0, "false")) == "beginning held by 0, reads no longer wait"
        page.eval("window.sameDocument = true")
        load.wait_acks(300)
        # Under load, each element's acknowledgement latency of the last second is shown.
        page.wait("[...document.querySelectorAll('#elements td.ack-p99')].every((td) => td.textContent.endsWith(' ms'))",
                  10, "an acknowledgement p99 for every element")
        kill_and_wait_out(cluster, "far")
        page.wait(f"{far_row()}?.dataset.state === 'failed'", 10, "far failed after its kill -9")
        page.screenshot(os.path.join(workdir, "status-page-far-failed.png"))
        burst = write_burst(workdir, uri, 160, seed=52)
        assert gap_left_the_queue(cluster.status(), "far"), "setup: far's gap is still in the write queue"
        cluster.restart_element("far")
        during, shown = [], []

        def sample(status):
            if element_of(status, "far").get("recovery") and not during:
                during.append(scrape(cluster))
            shown.append(page.eval(FAR_SHOWN))
            if shown[-1] and shown[-1]["progress"] and not [s for s in shown[:-1] if s and s["progress"]]:
                page.screenshot(os.path.join(workdir, "status-page-far-recovering.png"))
            return load.acks()

        status, samples = watch(cluster, back_in_sync("far"), 90, "far back in sync", interval=0.2, on_sample=sample)
        assert during, "no scrape while far was recovering"
        # The status page showed it without a reload: failed, then recovering with a progress
        # bar that moved, then in sync; its charts drew the writes and the replay.
        recovering = [s for s in shown if s and s["state"] == "recovering" and s["progress"]]
        assert recovering, f"the page never showed far recovering with a progress bar: {shown}"
        done = [s["progress"][0] for s in recovering]
        assert all(0 <= s["progress"][0] <= s["progress"][1] for s in recovering), recovering
        assert done == sorted(done) and len(set(done)) >= 2, f"the progress bar did not move: {recovering}"
        page.wait(f"{far_row()}?.dataset.state === 'in-sync'", 10, "far in sync again")
        assert page.eval("window.sameDocument === true"), "the page was reloaded"
        assert page.eval("samples.some((s) => s.write_iops > 0)"), "no write IOPS charted"
        assert page.eval("samples.some((s) => s.recovery_records_per_s > 0)"), "the replay was not charted"
        points = page.eval("document.querySelector('#chart-iops polyline[data-series=write]').getAttribute('points')")
        assert len(points.split()) >= 5, points
        # Readable on a phone: nothing wider than the screen but the tables' own scrolling.
        page.viewport(390, 844, mobile=True, scale=2)
        page.wait("document.documentElement.scrollWidth <= window.innerWidth", 5, "no sideways scrolling at 390 px")
        page.screenshot(os.path.join(workdir, "status-page-phone.png"))
        metrics = during[0]
        far, vol0 = (("element", "far"),), (("volume", "vol0"),)
        assert metrics[("starfish_element_state", (("element", "far"), ("state", "recovering")))] == 1, metrics
        assert metrics[("starfish_element_in_sync", far)] == 0
        assert metrics[("starfish_element_in_sync", (("element", "local"),))] == 1
        assert metrics[("starfish_element_recovery_total_records", far)] > 0
        assert metrics[("starfish_host_active", ())] == 1
        assert metrics[("starfish_volume_read_only", vol0)] == 0
        writes = (("op", "write"), ("volume", "vol0"))
        assert metrics[("starfish_host_request_duration_seconds_count", writes)] > 0
        assert metrics[("starfish_host_request_bytes_total", writes)] > 0
        assert metrics[("starfish_write_queue_capacity_bytes", vol0)] > 0
        after = scrape(cluster)
        assert after[("starfish_element_in_sync", far)] == 1
        assert after[("starfish_element_state", (("element", "far"), ("state", "recovering")))] == 0
        assert after[("starfish_host_request_duration_seconds_count", writes)] > metrics[
            ("starfish_host_request_duration_seconds_count", writes)]
        recovering = recovering_samples(samples, "far")
        print(f"paced replay: {len(recovering)} samples; "
              + ", ".join(f"{t:.1f}s {r['source']} {r['done_records']}/{r['total_records']} "
                          f"{r['records_per_second']:.0f}/s acks {a}" for t, r, a in recovering))
        assert recovering, f"no recovery seen in status; timeline: {timeline(samples, 'far')}"
        seen_for = recovering[-1][0] - recovering[0][0]
        assert seen_for >= 2.0, f"paced replay was visible for only {seen_for:.1f}s"
        sources = {r["source"] for _, r, _ in recovering}
        assert all(r["kind"] == "replay" for _, r, _ in recovering), recovering
        assert sources <= {"local", "near"} and len(sources) == 1, f"replay sources {sources}"
        done = [r["done_records"] for _, r, _ in recovering]
        assert done == sorted(done), f"done_records went down: {done}"
        assert len(set(done)) >= 3, f"done_records did not visibly increase: {done}"
        assert all(r["total_records"] > 0 and r["done_records"] <= r["total_records"] for _, r, _ in recovering)
        assert recovering[-1][2] > recovering[0][2], "no foreground write was acknowledged during the replay"
        last = element_of(status, "far")["last_recovery"]
        assert last["kind"] == "replay", last
        assert last["records"] >= burst.acked_count, (last, burst.acked_count)
        assert last["seconds"] >= 2.0, last
        load.wait_acks(300, what="acknowledged writes after far came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst)


SLOW_RATE_MIB = 4  # per second: below what the foreground writes below do (5..21 MiB/s measured)
# The foreground writes during that recovery: medium writes, so that what they add while the
# gap is pulled (about 40 MiB / 4 MiB/s = 10 s of them) fits the element's 256 MiB stash and
# the peers' replay logs.
HEAVY = dict(max_blocks=16, inflight=2)


def test_replay_slower_than_the_foreground_writes_converges(make_cluster, workdir):
    """A replay paced well below the foreground write rate still finishes:
    the element keeps the current writes aside while it pulls its gap, then
    commits them (before, it chased the newest sequence for ever)."""
    cluster = make_cluster_with_replay_log(
        make_cluster, BIG_REPLAY_LOG, host_extra=["--write-queue", SMALL_QUEUE, "--recovery-rate", f"{SLOW_RATE_MIB}MiB"]
    )
    uri = cluster.uri()
    with start_load(workdir, uri, seed=71) as load:
        load.wait_acks(300)
        kill_and_wait_out(cluster, "far")
        burst = write_burst(workdir, uri, 40, seed=72)
        assert gap_left_the_queue(cluster.status(), "far"), "setup: far's gap is still in the write queue"
        cluster.restart_element("far")
        # Large foreground writes all through the recovery, in their own region.
        heavy_offset = BURST_OFFSET + 128 * MiB
        with LoadWriter(workdir, uri, REGION_BLOCKS, 73, name="heavy", offset=heavy_offset, **HEAVY) as heavy:
            acked = AckedBytes(heavy.log_path)
            started = time.monotonic()
            status, samples = watch(
                cluster, back_in_sync("far"), 120, "far back in sync", interval=0.5, on_sample=lambda s: acked()
            )
            seconds = time.monotonic() - started
            foreground = acked() / MiB / seconds
            code = heavy.finish()
            assert code == 0, f"heavy writer exit {code}\n{heavy.output()}"
            heavy_log = harness.WriteLog(heavy.log_path, heavy_offset, REGION_BLOCKS)
        last = element_of(status, "far")["last_recovery"]
        print(f"replay of {last['records']} records in {last['seconds']:.1f} s at {SLOW_RATE_MIB} MiB/s "
              f"while the foreground wrote {foreground:.1f} MiB/s")
        assert last["kind"] == "replay", last
        # The setup, not a timing of the product: the foreground outran the recovery rate.
        assert foreground > SLOW_RATE_MIB, f"setup: foreground wrote only {foreground:.1f} MiB/s"
        load.wait_acks(100, what="acknowledged writes after far came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst, heavy_log)


def copying(s, name="far"):
    """`name` is in the block-copy phase of a full recovery."""
    e = element_of(s, name)
    r = e.get("recovery") or {}
    return e["state"] == "recovering" and r.get("kind") == "full" and r.get("phase") == "copy"


def full_recovery_done(name="far"):
    def done(s):
        e = element_of(s, name)
        return e["state"] == "in-sync" and (e.get("last_recovery") or {}).get("kind") == "full"
    return done


def element_log(cluster, name):
    with open(cluster.elements[name].process.log_path, errors="replace") as f:
        return f.read()


@pytest.mark.time_limit(150)
def test_full_recovery_past_every_replay_log(make_cluster, workdir):
    """With 32 MiB replay logs, 150 MiB written while an element is down cannot
    be replayed: the element copies the blocks that differ from a peer (full
    recovery), replays the writes made meanwhile and rejoins, under load; all
    three end identical. The copy sends only what differs: far already held
    the start of the load region."""
    cluster = make_cluster_with_replay_log(make_cluster, "32MiB", host_extra=["--write-queue", SMALL_QUEUE])
    uri = cluster.uri()
    with start_load(workdir, uri, seed=61) as load:
        load.wait_acks(300)
        kill_and_wait_out(cluster, "far")
        burst = write_burst(workdir, uri, 150, seed=62)
        status = cluster.status()
        assert gap_left_the_queue(status, "far"), f"setup: far's gap is still in the write queue: {status}"
        cluster.restart_element("far")
        status, samples = watch(cluster, full_recovery_done(), 90, "far back in sync by full recovery",
                                on_sample=lambda s: load.acks())
        last = element_of(status, "far")["last_recovery"]
        print(f"far: {last}; timeline: {timeline(samples, 'far')}")
        assert last["copied_bytes"] > 0, last
        # Only differing blocks travel: at most the two written regions (64 MiB each), not the
        # 1 GiB volume.
        assert last["copied_bytes"] <= 2 * REGION_BLOCKS * harness.BLOCK, last
        load.wait_acks(200, what="acknowledged writes after far came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst)


@pytest.mark.time_limit(150)
def test_full_recovery_of_a_wiped_element(make_cluster, workdir):
    """A replaced disk: far's data directory is emptied while it is down. It
    comes back with nothing, copies what its peers hold (skipping the
    never-written rest of the 1 GiB volume), and ends identical."""
    cluster = make_cluster_with_replay_log(make_cluster, "32MiB", host_extra=["--write-queue", SMALL_QUEUE])
    uri = cluster.uri()
    with start_load(workdir, uri, seed=81) as load:
        load.wait_acks(300)
        burst = write_burst(workdir, uri, 80, seed=82)
        kill_and_wait_out(cluster, "far")
        data = cluster.elements["far"].data
        harness.shutil.rmtree(data)
        harness.os.makedirs(data)
        load.wait_acks(100)
        cluster.restart_element("far")
        status, samples = watch(cluster, full_recovery_done(), 90, "the wiped far back in sync by full recovery",
                                on_sample=lambda s: load.acks())
        last = element_of(status, "far")["last_recovery"]
        print(f"far: {last}; timeline: {timeline(samples, 'far')}")
        assert 0 < last["copied_bytes"] <= 2 * REGION_BLOCKS * harness.BLOCK, last
        load.wait_acks(200, what="acknowledged writes after far came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst)


def paced_copy_cluster(make_cluster):
    """The cluster of the tests that interrupt a full recovery: Q=1 (writable while the
    copy's source is down), 128 MiB replay logs, a small write queue, copies paced at
    40 MiB/s."""
    return make_cluster_with_replay_log(
        make_cluster, "128MiB", quorum=1, host_extra=["--write-queue", SMALL_QUEUE, "--recovery-rate", "40MiB"]
    )


def wipe_far_after_a_fill(cluster, workdir, uri, fill_seed, burst_seed):
    """256 MiB of fill writes and a 100 MiB burst (more history than the replay logs hold),
    then far killed, its data wiped and restarted: it needs a full recovery. Returns the fill's
    write log and the burst, for `verify_all`."""
    fill_offset, fill_blocks = 512 * MiB, 65536  # 256 MiB
    with LoadWriter(workdir, uri, fill_blocks, fill_seed, name="fill", offset=fill_offset, **BURST) as fill:
        acked = AckedBytes(fill.log_path)
        wait_until(lambda: acked() >= 256 * MiB or not fill.process.alive(), 120, "256 MiB of fill writes")
        assert fill.finish() == 0, fill.output()
    fill_log = harness.WriteLog(fill.log_path, fill_offset, fill_blocks)
    burst = write_burst(workdir, uri, 100, seed=burst_seed)
    kill_and_wait_out(cluster, "far")
    data = cluster.elements["far"].data
    harness.shutil.rmtree(data)
    harness.os.makedirs(data)
    cluster.restart_element("far")
    return fill_log, burst


@pytest.mark.time_limit(180)
@pytest.mark.parametrize("victim", ["target", "source"])
def test_full_recovery_resumes_after_a_kill(make_cluster, workdir, victim):
    """A paced full recovery of a wiped element is interrupted by kill -9 of
    the element copying (it restarts and resumes from its saved cursor) or of
    the peer it copies from (it goes on from the other peer, from where it
    was). It converges either way and all three end identical. Q=1, so that the
    volume stays writable while the source is down. Sizes: about 420 MiB of
    history (more than the 128 MiB replay logs, so the wiped element cannot
    replay it all), about 380 MiB of it live data (the copy at 40 MiB/s takes
    seconds), a light load meanwhile (one 4 KiB write at a time), whose writes
    during the copy the replay logs still hold after it."""
    cluster = paced_copy_cluster(make_cluster)
    uri = cluster.uri()
    light = dict(max_blocks=1, inflight=1)
    with LoadWriter(workdir, uri, REGION_BLOCKS, 91, name="load", offset=LOAD_OFFSET, **light) as load:
        load.wait_acks(300)
        fill_log, burst = wipe_far_after_a_fill(cluster, workdir, uri, 93, 92)
        # The target is killed after its first cursor save (every 64 MiB), the source early.
        enough = (72 if victim == "target" else 24) * MiB

        def well_into_the_copy(s):
            r = element_of(s, "far").get("recovery") or {}
            return copying(s) and r.get("copied_bytes", 0) >= enough and r.get("done_bytes", 0) > 0

        status, samples = watch(cluster, well_into_the_copy, 60, "far well into a paced copy", interval=0.05)
        r = element_of(status, "far")["recovery"]
        print(f"before the kill: {r}")
        if victim == "target":
            cluster.kill_element("far", signal.SIGKILL)
            cluster.restart_element("far")
        else:
            source = r["source"]
            cluster.kill_element(source, signal.SIGKILL)
        status, after = watch(cluster, full_recovery_done(), 120, "far back in sync after the interruption",
                              on_sample=lambda s: load.acks())
        samples += after
        print(f"far: {element_of(status, 'far')['last_recovery']}; timeline: {timeline(samples, 'far')}")
        far_log = element_log(cluster, "far")
        if victim == "target":
            assert "resuming an interrupted copy" in far_log, "far started its copy over instead of resuming"
        else:
            cluster.restart_element(source)
            host_log = open(cluster.host.log_path, errors="replace").read()
            assert "resuming from" in host_log, "the copy did not go on from the other peer"
        load.wait_acks(200, what="acknowledged writes after the interruption")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst, fill_log)


@pytest.mark.time_limit(240)
def test_full_recovery_converges_through_repeated_kills_of_the_target(make_cluster, workdir):
    """The element a paced full recovery rebuilds is killed (-9) three times in its copy, at
    different points (before its first cursor save, later, and again after a resume), and
    restarted each time. Each restart goes on with a full recovery (never a replay or a quick
    one: its volume holds no consistent content), the last one ends in sync, and all three
    replicas end identical with every acknowledged write. Same set-up as the test above."""
    cluster = paced_copy_cluster(make_cluster)
    uri = cluster.uri()
    light = dict(max_blocks=1, inflight=1)
    with LoadWriter(workdir, uri, REGION_BLOCKS, 94, name="load", offset=LOAD_OFFSET, **light) as load:
        load.wait_acks(300)
        fill_log, burst = wipe_far_after_a_fill(cluster, workdir, uri, 95, 96)
        samples = []
        # Bytes copied since the restart before each kill (a cursor is saved every 64 MiB or
        # 2 s, so the first kills come before any save of their pass).
        for point in [8, 40, 24]:
            def copied_enough(s, point=point):
                r = element_of(s, "far").get("recovery") or {}
                return copying(s) and r.get("copied_bytes", 0) >= point * MiB

            status, more = watch(cluster, copied_enough, 90, f"far {point} MiB into a full recovery's copy",
                                 interval=0.05)
            samples += more
            print(f"killed at: {element_of(status, 'far')['recovery']}")
            cluster.kill_element("far", signal.SIGKILL)
            cluster.restart_element("far")
        status, after = watch(cluster, full_recovery_done(), 150, "far back in sync after the last kill",
                              on_sample=lambda s: load.acks())
        samples += after
        print(f"far: {element_of(status, 'far')['last_recovery']}; timeline: {timeline(samples, 'far')}")
        load.wait_acks(200, what="acknowledged writes after the kills")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    verify_all(cluster, workdir, uri, load, burst, fill_log)


@pytest.mark.time_limit(180)
@pytest.mark.parametrize("quorum", [1, 2], ids=["Q1", "Q2"])
def test_replay_source_killed_mid_replay(make_cluster, workdir, quorum):
    """The peer a paced replay pulls from is killed in the middle of it. The
    recovering element ends failed (and says why) or goes on from the other
    peer; the volume keeps serving (read-write with Q=1; with Q=2 one in-sync
    element is below quorum, so read-only until two are in sync again); no
    acknowledged write is lost. The killed source then returns and all three
    end identical."""
    cluster = make_cluster_with_replay_log(
        make_cluster,
        BIG_REPLAY_LOG,
        quorum=quorum,
        host_extra=["--write-queue", SMALL_QUEUE, "--recovery-rate", FAST_PACED_RATE],
    )
    uri = cluster.uri()
    with start_load(workdir, uri, seed=71) as load:
        load.wait_acks(300)
        kill_and_wait_out(cluster, "far")
        burst = write_burst(workdir, uri, 160, seed=72)
        assert gap_left_the_queue(cluster.status(), "far"), "setup: far's gap is still in the write queue"
        cluster.restart_element("far")

        switches_before = replay_switches(cluster, "far")

        def replaying(s):
            """far is pulling from a peer: records arrived, and it has not switched to the queue."""
            far = element_of(s, "far")
            r = far.get("recovery")
            return (far["state"] == "recovering" and r and r["kind"] == "replay"
                    and r["source"] in ("local", "near") and 0 < r["done_records"] < r["total_records"] // 2
                    and replay_switches(cluster, "far") == switches_before)

        status, samples = watch(cluster, replaying, 30, "far replaying from a peer", interval=0.05)
        source = element_of(status, "far")["recovery"]["source"]
        other = ({"local", "near"} - {source}).pop()
        cluster.kill_element(source, signal.SIGKILL)
        killed_at = len(samples)

        # Within 30 s: far failed with a reason, or replaying from (or in sync through) the other peer.
        def settled(s):
            far = element_of(s, "far")
            if far["state"] == "failed" and far.get("reason") and far["reason"] != "handshake in progress":
                return True
            if far["state"] == "recovering" and (far.get("recovery") or {}).get("source") == other:
                return True
            return far["state"] == "in-sync"

        status, after = watch(cluster, settled, 30, f"far to fail or go on from {other} after {source} was killed",
                              on_sample=lambda s: load.acks())
        samples += after
        far = element_of(status, "far")
        print(f"after killing the source {source}: far {far['state']} "
              f"{far.get('reason') or far.get('recovery')}; timeline: {timeline(samples[killed_at - 1:])}")
        for _, s, _ in after:
            assert element_of(s, other)["state"] == "in-sync", s
            mode = volume_status(s)["mode"]
            assert mode in (("read-write",) if quorum == 1 else ("read-write", "read-only")), s

        # The volume serves reads; with Q=1 it also keeps taking writes.
        with Client(uri) as client:
            client.pread(4 * MiB, LOAD_OFFSET)
            client.pread(4 * MiB, BURST_OFFSET)
        if quorum == 1:
            load.wait_acks(200, what=f"acknowledged writes with {source} killed and far not in sync")

        # The source comes back. Today far is re-admitted by itself; should a failed far instead
        # stay failed, it is restarted as an operator would, and must then catch up.
        cluster.restart_element(source)
        back_at = time.monotonic()

        def healthy_or_far_left_failed(s):
            return harness.healthy(s) or (
                time.monotonic() - back_at > 10
                and element_of(s, source)["state"] == "in-sync"
                and element_of(s, "far")["state"] == "failed"
            )

        status, after = watch(cluster, healthy_or_far_left_failed, 120,
                              "all three in sync after the source came back", interval=0.25)
        samples += after
        restarted_far = not harness.healthy(status)
        if restarted_far:
            cluster.kill_element("far", signal.SIGKILL)
            cluster.restart_element("far")
            status, more = watch(cluster, harness.healthy, 120, "all three in sync after far was restarted",
                                 interval=0.25)
            after += more
        print(f"recovered{' (far restarted)' if restarted_far else ''}: "
              f"{[(e['name'], e.get('last_recovery')) for e in status['elements']]}; timeline: {timeline(after)}")
        load.wait_acks(300, what="acknowledged writes after everything came back")
        code = load.finish()
        assert code == 0, f"writer exit {code}\n{load.output()}"
    log = load_log(workdir, load)
    assert log.done
    if quorum == 1:
        assert not log.failed, f"writes failed with Q=1 and an in-sync element: {log.failed[:10]}"
    else:
        # Read-only below quorum: writes then fail with EPERM (new) or EIO (in flight), never silently.
        bad = [line for line in log.failed if int(line.split()[2]) not in (errno.EPERM, errno.EIO)]
        assert not bad, f"writes failed otherwise than EPERM/EIO: {bad[:10]}"
    check_writes(uri, log, burst)
    cluster.wait_caught_up()
    stop_and_compare(cluster)


@pytest.mark.time_limit(150)
def test_host_restart_while_an_element_is_down(cluster, workdir):
    """The host element is restarted (SIGTERM) while an element is down; the
    new host element's write queue is empty, so when the element returns it
    replays its gap from a peer and the three end identical."""
    uri = cluster.uri()
    with start_load(workdir, uri, seed=81, name="load1") as load1:
        load1.wait_acks(300)
        kill_and_wait_out(cluster, "far")
        load1.wait_acks(500, what="acknowledged writes with far down")
        code, killed = cluster.stop_host(signal.SIGTERM)
        assert not killed, "host ignored SIGTERM"
        assert code == 0, f"host exited with {code} on SIGTERM"
        assert load1.process.wait(60) is not None, "writer did not stop when the host element went away"
    first = load_log(workdir, load1)

    cluster.start_host(ready=False)
    cluster.wait_status(
        lambda s: volume_status(s)["mode"] == "read-write"
        and all(element_of(s, n)["state"] == "in-sync" for n in ("local", "near")),
        30,
        "the new host element read-write with local and near",
    )
    with start_load(workdir, uri, seed=82, name="load2", first_generation=first.max_generation + 1) as load2:
        load2.wait_acks(500)
        cluster.restart_element("far")
        status, samples = watch(cluster, back_in_sync("far"), 60, "far back in sync", interval=0.05)
        last = element_of(status, "far")["last_recovery"]
        print(f"far after the host restart: last_recovery {last}; timeline: {timeline(samples, 'far')}")
        assert last["kind"] == "replay", f"last_recovery {last}; timeline: {timeline(samples, 'far')}"
        for _, recovery, _ in recovering_samples(samples, "far"):
            assert recovery["kind"] == "replay" and recovery["source"] in ("local", "near"), recovery
        load2.wait_acks(300, what="acknowledged writes after far came back")
        code = load2.finish()
        assert code == 0, f"writer exit {code}\n{load2.output()}"
    log = load_log(workdir, load1, load2)
    failed_after_restart = [line for line in log.failed if int(line.split()[1]) > first.max_generation]
    assert not failed_after_restart, f"writes failed after the host restart: {failed_after_restart[:10]}"
    check_writes(uri, log)
    cluster.wait_caught_up()
    stop_and_compare(cluster)


@pytest.mark.time_limit(240)
def test_placed_writes_are_written_once_and_replayed_from_the_data_file(make_cluster):
    """Elements started with `--placed-writes` take large writes into holes into their data
    files and log only the blocks' checksums: a 64 MiB first fill leaves each element's log
    far smaller than what was written. An element down while more is written into holes,
    past the write queue, catches up by replay: its peer reads those writes back from its
    data file. It does so too when their blocks were written again before it came back: the
    peer logged a copy of their data before it overwrote them. The replicas end identical
    each time."""
    cluster = make_cluster(volumes=(("vol0", "256MiB"),), host_extra=["--write-queue", SMALL_QUEUE],
                           element_extra=["--placed-writes"])
    fill = harness.random_bytes(64 * MiB, seed=51)
    with Client(cluster.uri()) as client:
        for at in range(0, len(fill), MiB):
            client.pwrite(fill[at:at + MiB], at)
        client.flush()
    cluster.wait_caught_up()
    sizes = {name: element.log_bytes() for name, element in cluster.elements.items()}
    assert all(size < 16 * MiB for size in sizes.values()), f"logs after a 64 MiB fill: {sizes}"

    def far_down_while(write):
        """`write(client)` while far is down, past the write queue; far's recovery then."""
        kill_and_wait_out(cluster, "far")
        with Client(cluster.uri()) as client:
            write(client)
            client.flush()
        assert gap_left_the_queue(cluster.status(), "far"), "setup: far's gap is still in the write queue"
        cluster.restart_element("far")
        status, samples = watch(cluster, back_in_sync("far"), 90, "far back in sync")
        return element_of(status, "far")["last_recovery"], timeline(samples, "far")

    def write_more(client, at):
        for piece in range(0, len(more), MiB):
            client.pwrite(more[piece:piece + MiB], at + piece)

    # Into holes while far is down: replay, from a peer's data file.
    more = harness.random_bytes(64 * MiB, seed=52)
    last, seen = far_down_while(lambda client: write_more(client, 64 * MiB))
    assert last["kind"] == "replay", f"last_recovery {last}; timeline: {seen}"

    # The same, but some of those blocks are written again before far is back: still a
    # replay, the overwritten blocks' placed data served from the copies in the peer's log.
    def write_more_twice(client):
        write_more(client, 128 * MiB)
        client.pwrite(fill[:MiB], 128 * MiB + 4096)

    last, seen = far_down_while(write_more_twice)
    assert last["kind"] == "replay", f"last_recovery {last}; timeline: {seen}"
    with Client(cluster.uri()) as client:
        def read(length, offset):
            return b"".join(client.pread(MiB, offset + at) for at in range(0, length, MiB))

        assert read(64 * MiB, 0) == fill
        assert read(64 * MiB, 64 * MiB) == more
        assert read(MiB, 128 * MiB + 4096) == fill[:MiB]
    stop_and_compare(cluster)


def test_a_stopped_host_element_leaves_the_in_sync_copies_alike(make_linked_cluster):
    """SIGTERM: the host element answers what it took, then waits (at most 2 s) until every
    in-sync element applied what it sent. `far` sits 150 ms away, so the quorum (local and
    near) answers each write long before far holds it; the host element is stopped right
    after the last answer, then the elements, and far's copy must equal the others'."""
    cluster = make_linked_cluster({"far": (150, None)})
    harness.run(["qemu-io", "-f", "raw", "-c", "write -P 0x4c 0 4M", "-c", "flush", cluster.uri("vol0")])
    code, killed = cluster.stop_host()
    assert (code, killed) == (0, False), f"the host element stops cleanly (exit {code}, killed {killed})"
    assert not cluster.stop()
    copies = {name: element.verify() for name, element in cluster.elements.items()}
    vol0 = {name: next(v for v in report["volumes"] if v["name"] == "vol0") for name, report in copies.items()}
    digests = {name: (v["applied_sequence"], v["digest"]) for name, v in vol0.items()}
    assert len(set(digests.values())) == 1, f"the elements' copies of vol0 differ after a clean stop: {digests}"
