"""Failures of real processes: elements killed under write load and brought
back (quick recovery, also while writes go on and while it is recovering),
an element frozen, two elements down (read-only: writes refused; reads too once
the read lease runs out), the host
stopped, the host and the whole cluster killed under load."""

import errno
import os
import signal
import time

import pytest

import harness
from harness import MiB, Client, LoadWriter, volume_status

REGION_BLOCKS = 16384  # 64 MiB of 4 KiB blocks


def digests_agree(cluster):
    """Stops the cluster cleanly, runs `element verify` on every element and
    checks that they hold the same volumes with identical digests."""
    complaints = cluster.stop()
    assert not complaints, complaints
    reports = {name: element.verify() for name, element in cluster.elements.items()}
    by_volume = {}
    for name, report in reports.items():
        for volume in report["volumes"]:
            by_volume.setdefault(volume["name"], {})[name] = volume
    # Every element also holds the catalog of volumes created while running (issue 15).
    expected = {name for name, _ in cluster.volumes} | {".catalog"}
    assert set(by_volume) == expected, f"volumes in verify reports: {reports}"
    for volume, per_element in by_volume.items():
        assert set(per_element) == set(cluster.elements), f"{volume} missing on some element: {reports}"
        digests = {name: v["digest"] for name, v in per_element.items()}
        sequences = {name: v["applied_sequence"] for name, v in per_element.items()}
        sizes = {name: v["size_bytes"] for name, v in per_element.items()}
        assert len(set(digests.values())) == 1, f"{volume}: replicas differ: digests {digests}"
        assert len(set(sequences.values())) == 1, f"{volume}: applied sequences differ: {sequences}"
        assert len(set(sizes.values())) == 1, f"{volume}: sizes differ: {sizes}"
    return reports


def combined_log(workdir, writers, blocks=REGION_BLOCKS):
    path = os.path.join(workdir, "writes.log")
    with open(path, "w") as out:
        for writer in writers:
            with open(writer.log_path) as f:
                out.write(f.read())
    return harness.WriteLog(path, 0, blocks)


def check_region(uri, write_log):
    with Client(uri) as client:
        problems = harness.check_stamped_region(client, write_log)
    assert not problems, "\n".join(problems)


def not_in_sync(cluster, name):
    return lambda s: cluster.element_state(s, name) != "in-sync"


@pytest.mark.time_limit(600)
def test_kill9_elements_under_write_load(cluster, workdir):
    """Each element in turn is killed with writes in flight and restarted on
    its data directory while the writes go on; it catches up by itself.
    Every acknowledged write is read back; the replicas end identical."""
    uri = cluster.uri()
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=7, name="writer1") as writer:
        writer.wait_acks(500)
        for victim in ("local", "far", "near"):
            cluster.kill_element(victim, signal.SIGKILL)
            writer.wait_acks(500, what=f"acknowledged writes with {victim} down")
            status = cluster.wait_status(not_in_sync(cluster, victim), 30, f"{victim} reported not in-sync")
            assert volume_status(status)["mode"] == "read-write", status
            cluster.restart_element(victim)
            cluster.wait_healthy(timeout=90)
            writer.wait_acks(500, what=f"acknowledged writes after {victim} came back")

        # Killed again while it is still catching up (or just after).
        cluster.kill_element("local", signal.SIGKILL)
        writer.wait_acks(300)
        cluster.restart_element("local")
        cluster.kill_element("local", signal.SIGKILL)
        writer.wait_acks(300)
        cluster.restart_element("local")
        cluster.wait_healthy(timeout=90)
        writer.wait_acks(300)
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"

    write_log = combined_log(workdir, [writer])
    assert write_log.done
    assert not write_log.failed, f"writes failed with one element down: {write_log.failed[:10]}"
    check_region(uri, write_log)

    status = cluster.wait_caught_up()
    acked = volume_status(status)["acked_sequence"]
    reports = digests_agree(cluster)
    for report in reports.values():
        assert report["volumes"][0]["applied_sequence"] == acked, (acked, reports)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("victim", ["local", "far"])
def test_kill9_element_then_quick_recovery(cluster, workdir, victim):
    """The element is killed with writes in flight, writes go on with two,
    then it comes back on its own data directory and is in sync again."""
    uri = cluster.uri()
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=11, name="writer1") as writer:
        writer.wait_acks(300)
        cluster.kill_element(victim, signal.SIGKILL)
        writer.wait_acks(300, what=f"acknowledged writes with {victim} down")
        status = cluster.wait_status(not_in_sync(cluster, victim), 30, f"{victim} reported not in-sync")
        assert volume_status(status)["mode"] == "read-write", status
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"
    first = combined_log(workdir, [writer])
    assert not first.failed, f"writes failed with one element down: {first.failed[:10]}"
    check_region(uri, first)

    cluster.restart_element(victim)
    cluster.wait_healthy(timeout=90)
    with LoadWriter(
        workdir, uri, REGION_BLOCKS, seed=12, name="writer2", first_generation=first.max_generation + 1
    ) as writer2:
        writer2.wait_acks(300)
        code = writer2.finish()
        assert code == 0, f"writer exit {code}\n{writer2.output()}"
    write_log = combined_log(workdir, [writer, writer2])
    assert not write_log.failed, write_log.failed[:10]
    check_region(uri, write_log)

    status = cluster.wait_caught_up()
    acked = volume_status(status)["acked_sequence"]
    reports = digests_agree(cluster)
    for report in reports.values():
        assert report["volumes"][0]["applied_sequence"] == acked, (acked, reports)


@pytest.mark.time_limit(420)
def test_frozen_element_does_not_stall_writes(cluster, workdir):
    """An element that stops answering (SIGSTOP: a hung process or a cut
    link) must not stall the host: writes go on with the other two. When it
    wakes up it catches up."""
    uri = cluster.uri()
    far = cluster.elements["far"].process
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=13) as writer:
        try:
            writer.wait_acks(200)
            far.freeze()
            writer.wait_acks(1000, timeout=60, what="acknowledged writes with far frozen")
        finally:
            far.resume()
        writer.wait_acks(200)
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"
    write_log = combined_log(workdir, [writer])
    assert not write_log.failed, write_log.failed[:10]
    check_region(uri, write_log)
    cluster.wait_caught_up(timeout=90)
    digests_agree(cluster)


@pytest.mark.time_limit(420)
def test_two_elements_down_read_only_then_read_write(cluster):
    uri = cluster.uri()
    data = harness.random_bytes(4 * MiB, seed=11)
    with Client(uri) as client:
        client.pwrite(data, 0)
        client.flush()

    survivor = Client(uri)  # a connection that lives through the failure
    try:
        cluster.kill_element("near", signal.SIGKILL)
        cluster.kill_element("far", signal.SIGKILL)
        status = cluster.wait_status(
            lambda s: volume_status(s)["mode"] == "read-only", 30, "vol0 to turn read-only"
        )
        for name in ("near", "far"):
            element = next(e for e in status["elements"] if e["name"] == name)
            assert element["state"] == "failed", status
            assert element.get("reason"), f"failed element {name} has no reason: {status}"

        # Once the read leases of the dead elements have run out (0.45 s), one element of three
        # answers no read either: a newer host element could hold the other two and have
        # overwritten the data (ARCHITECTURE.md, "Failover"). Reads wait for a lease, then EIO.
        time.sleep(1.0)
        with Client(uri) as fresh:
            for client in (survivor, fresh):
                harness.expect_nbd_error(lambda: client.pread(4096, 0), {errno.EIO}, "read without the read lease")
                harness.expect_nbd_error(
                    lambda: client.pwrite(b"\x5a" * 4096, 0), {errno.EPERM}, "write while read-only"
                )
                harness.expect_nbd_error(lambda: client.zero(4096, 8192), {errno.EPERM}, "write-zeroes while read-only")
                harness.expect_nbd_error(lambda: client.trim(4096, 16384), {errno.EPERM}, "trim while read-only")
        assert volume_status(cluster.status())["mode"] == "read-only"

        # One element back in sync makes two: read-write again, by itself.
        cluster.restart_element("near")
        cluster.wait_status(
            lambda s: volume_status(s)["mode"] == "read-write" and cluster.element_state(s, "near") == "in-sync",
            90,
            "vol0 to turn read-write with near back in sync",
        )
        survivor.pwrite(b"\xa5" * 4096, 4096)
        assert survivor.pread(12288, 0) == data[:4096] + b"\xa5" * 4096 + data[8192:12288]
    finally:
        survivor.close()

    with Client(uri) as client:
        assert client.pread(4 * MiB, 0) == data[:4096] + b"\xa5" * 4096 + data[8192:]

    cluster.restart_element("far")
    cluster.wait_caught_up(timeout=90)
    digests_agree(cluster)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_host_restart_keeps_data(cluster, stop_signal):
    uri = cluster.uri()
    data = harness.random_bytes(8 * MiB, seed=21)
    stamps = {600 * MiB + i * 64 * 1024: harness.stamp_block(600 * MiB + i * 64 * 1024, 5) for i in range(64)}
    with Client(uri) as client:
        client.pwrite(data, 0)
        client.flush()
        # Acknowledged but not flushed: durable on Q elements all the same.
        for offset, block in stamps.items():
            client.pwrite(block, offset)
    acked_before = volume_status(cluster.status())["acked_sequence"]

    code, killed = cluster.stop_host(stop_signal)
    if stop_signal == signal.SIGTERM:
        assert not killed, "host ignored SIGTERM"
        assert code == 0, f"host exited with {code} on SIGTERM"
    cluster.start_host()

    with Client(uri) as client:
        assert client.pread(8 * MiB, 0) == data, "data written before the host restart differs"
        for offset, block in stamps.items():
            assert bytes(client.pread(len(block), offset)) == block, f"acknowledged write at {offset} lost"
        client.pwrite(b"\x77" * 4096, 0)
        assert client.pread(4096, 0) == b"\x77" * 4096
    status = cluster.wait_caught_up()
    assert volume_status(status)["acked_sequence"] > acked_before
    digests_agree(cluster)


WRITE_SIZES = {"small": dict(max_blocks=4, inflight=16), "large": dict(max_blocks=8192, inflight=4)}


def crash_and_check(cluster, workdir, kill, sizes):
    """Runs a write load, calls `kill()` in the middle of it, restarts what
    is down, and checks: every acknowledged write is there, no request is
    torn, the replicas converge."""
    uri = cluster.uri()
    options = WRITE_SIZES[sizes]
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=17, **options) as writer:
        writer.wait_acks(1000 if sizes == "small" else 20)
        kill()
        writer.process.wait(60)  # its connection broke: it stops by itself
    for element in cluster.elements.values():
        if not element.process.alive():
            element.start()
    if not cluster.host.alive():
        cluster.start_host()
    else:
        cluster.wait_healthy()

    check_region(uri, combined_log(workdir, [writer]))
    write_again_and_converge(cluster, workdir, writer, REGION_BLOCKS, 18, 300 if sizes == "small" else 10, options)


def write_again_and_converge(cluster, workdir, first, blocks, seed, acks, options):
    """After a crash and a check of what `first` wrote: the volume takes `acks` more writes,
    every acknowledged write of both writers reads back, and every replica ends the same."""
    uri = cluster.uri()
    first_log = combined_log(workdir, [first], blocks)
    with LoadWriter(
        workdir, uri, blocks, seed=seed, name="writer2", first_generation=first_log.max_generation + 1, **options
    ) as writer2:
        writer2.wait_acks(acks)
        code = writer2.finish()
        assert code == 0, f"writer exit {code}\n{writer2.output()}"
    check_region(uri, combined_log(workdir, [first, writer2], blocks))
    cluster.wait_caught_up(timeout=90)
    digests_agree(cluster)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("sizes", sorted(WRITE_SIZES))
def test_kill9_host_under_write_load(cluster, workdir, sizes):
    crash_and_check(cluster, workdir, lambda: cluster.host.kill9(), sizes)


@pytest.mark.time_limit(420)
@pytest.mark.parametrize("sizes", sorted(WRITE_SIZES))
def test_kill9_everything_under_write_load(cluster, workdir, sizes):
    """Power failure: the host and all three elements die at once."""

    def kill_all():
        for process in [cluster.host] + [e.process for e in cluster.elements.values()]:
            process.send_signal(signal.SIGKILL)
        for process in [cluster.host] + [e.process for e in cluster.elements.values()]:
            process.wait(20)

    crash_and_check(cluster, workdir, kill_all, sizes)


@pytest.mark.time_limit(420)
def test_lagging_element_is_failed_when_the_write_queue_fills(make_cluster, workdir):
    """A frozen element cannot hold the write queue hostage: once its
    entries would be overwritten, the host throttles briefly, declares it
    failed and goes on with the other two. The heartbeat timeout is made
    longer than the test, so that only the full write queue can fail it."""
    cluster = make_cluster(host_extra=["--write-queue", "40MiB", "--heartbeat-timeout", "10min"])
    uri = cluster.uri()
    far = cluster.elements["far"].process
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=19, max_blocks=16) as writer:
        try:
            writer.wait_acks(100)
            far.freeze()
            # About 100 MiB of writes: well past the 40 MiB write queue.
            writer.wait_acks(3000, timeout=120, what="acknowledged writes past a full write queue")
            status = cluster.wait_status(
                lambda s: cluster.element_state(s, "far") == "failed", 30, "far to be declared failed"
            )
            assert volume_status(status)["mode"] == "read-write", status
            far_status = harness.element_of(status, "far")
            assert far_status.get("reason", "").startswith("too slow: volume vol0 write queue full"), far_status
        finally:
            far.resume()
        writer.wait_acks(200)
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"
    write_log = combined_log(workdir, [writer])
    assert not write_log.failed, write_log.failed[:10]
    check_region(uri, write_log)


@pytest.mark.time_limit(420)
def test_kill9_element_under_large_writes(make_cluster, workdir):
    """Requests of up to 32 MiB (the maximum) with an element killed and
    restarted in the middle: each lands whole or, if unacknowledged, not at
    all; the replicas converge. (The write queue is made big enough for the
    gap, so that quick recovery applies.)"""
    cluster = make_cluster(host_extra=["--write-queue", "1GiB"])
    uri = cluster.uri()
    with LoadWriter(workdir, uri, REGION_BLOCKS, seed=23, max_blocks=8192, inflight=4) as writer:
        writer.wait_acks(20)
        cluster.kill_element("near", signal.SIGKILL)
        writer.wait_acks(4, what="large writes with near down")
        cluster.restart_element("near")
        cluster.wait_healthy(timeout=120)
        writer.wait_acks(20)
        code = writer.finish()
        assert code == 0, f"writer exit {code}\n{writer.output()}"
    write_log = combined_log(workdir, [writer])
    assert not write_log.failed, write_log.failed[:10]
    check_region(uri, write_log)
    cluster.wait_caught_up(timeout=90)
    digests_agree(cluster)
