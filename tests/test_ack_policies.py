"""Ack policies per element (issue 14), with real processes: what each policy lets a write's
answer wait for. `network-sync` counts once the write is on the wire toward the element (here
a far element that is stopped and stores nothing), `local-sync` never counts, `received` counts
once the write is in the element's memory; a FLUSH still waits until Q elements hold the
writes durably; `starfish status` shows each element's policy."""

import json
import os
import signal
import subprocess
import time

import nbd
import pytest

import harness
from harness import Client, element_of, random_bytes


# The tests that stop elements run the host element with a heartbeat timeout far past the time
# they stay stopped (3 s by default), so that a busy machine's delays cannot fail a stopped
# element, turn the volume read-only and change what a write waits for.
PATIENT = ["--heartbeat-timeout", "30s"]


def connected(uri):
    """A libnbd handle connected to `uri`. Connect before stopping elements: the host element
    fails an element it has not heard from for its heartbeat timeout, and a connection made after
    the stop, on a busy machine, took long enough (with the default 3 s) that the write the test
    then sent was refused instead (the volume had become read-only)."""
    h = nbd.NBD()
    h.connect_uri(uri)
    return h


def start_write(h, data, offset):
    """One write under way on `h`: its cookie."""
    return h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), offset)


def completes_within(h, cookie, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if h.aio_command_completed(cookie):
            return True
        h.poll(50)
    return False


def stopped(cluster, *names):
    """SIGSTOP these elements, back once every thread of each is stopped; the caller resumes
    them (`resume`)."""
    for name in names:
        cluster.elements[name].process.freeze()


def resume(cluster, *names):
    for name in names:
        cluster.elements[name].process.resume()


@pytest.mark.time_limit(120)
def test_network_sync_counts_on_the_wire_and_local_sync_never(make_cluster):
    cluster = make_cluster(
        volumes=(("vol0", "64MiB"),), ack={"far": "network-sync"}, use_config=True, host_extra=PATIENT)
    status = cluster.status()
    assert {e["name"]: e["ack_policy"] for e in status["elements"]} == \
        {"local": "durable", "near": "durable", "far": "network-sync"}
    text = subprocess.run([harness.starfish_bin(), "status", "--admin", cluster.admin], capture_output=True,
                          text=True, timeout=30).stdout
    assert "network-sync" in text, text

    # near and far stopped: local (durable) + far (network-sync: the write is in far's socket
    # buffer, it stores nothing) are a quorum of 2.
    data = random_bytes(64 * 1024, 1)
    h = connected(cluster.uri())
    stopped(cluster, "near", "far")
    try:
        cookie = start_write(h, data, 0)
        answered = completes_within(h, cookie, 1.5)
    finally:
        resume(cluster, "near", "far")
    assert answered, "a network-sync element counts once the write is on the wire"
    h.flush()
    h.shutdown()
    cluster.wait_healthy(timeout=30)
    with Client(cluster.uri()) as c:
        assert c.pread(len(data), 0) == data


@pytest.mark.time_limit(120)
def test_local_sync_does_not_count_and_received_does(make_cluster):
    cluster = make_cluster(
        volumes=(("vol0", "64MiB"),), ack={"near": "received", "far": "local-sync"}, host_extra=PATIENT)
    data = random_bytes(64 * 1024, 2)
    # near stopped: local (durable) and far (local-sync, never counted) are not a quorum.
    h = connected(cluster.uri())
    stopped(cluster, "near")
    try:
        cookie = start_write(h, data, 0)
        answered_early = completes_within(h, cookie, 1.0)
    finally:
        resume(cluster, "near")
    assert not answered_early, "a local-sync element must not count toward the quorum"
    assert completes_within(h, cookie, 10), "once near is back, the write is answered"
    h.flush()
    h.shutdown()
    cluster.wait_healthy(timeout=30)
    # far stopped: local (durable) and near (received) are a quorum; a FLUSH waits for Q
    # durable copies, which local and near give.
    stopped(cluster, "far")
    try:
        with Client(cluster.uri(), timeout=5) as c:
            c.pwrite(data, MIB)
            c.flush()
            assert c.pread(len(data), MIB) == data
    finally:
        resume(cluster, "far")
    cluster.wait_healthy(timeout=30)


MIB = 1 << 20


@pytest.mark.time_limit(180)
def test_flushed_writes_survive_kill_9_of_everything_under_received_policies(make_cluster):
    # Two of three elements count on receipt: writes are answered from their memory, but a
    # FLUSH waits for Q durable copies, so what a flush covered survives kill -9 of every
    # process.
    cluster = make_cluster(volumes=(("vol0", "64MiB"),), ack={"near": "received", "far": "received"})
    blocks = {}
    with Client(cluster.uri()) as c:
        for i in range(256):
            data = random_bytes(4096, 1000 + i)
            c.pwrite(data, i * 65536)
            blocks[i * 65536] = data
        c.flush()
    cluster.host.kill9()
    for name in cluster.elements:
        cluster.kill_element(name)
    for name in cluster.elements:
        cluster.restart_element(name)
    cluster.start_host()
    with Client(cluster.uri()) as c:
        for offset, data in blocks.items():
            assert c.pread(4096, offset) == data, f"flushed block at {offset} lost"


@pytest.mark.time_limit(240)
def test_a_weak_write_a_start_did_without_stays_out_after_its_holder_returns(make_cluster):
    # Bug 7 (docs/testing.md) with real processes, through two host element starts. A write is
    # acknowledged by local (durable) and far (network-sync: on the wire, never stored) and
    # reaches no other element. A start without local does without it, as the weaker promise
    # allows, and reads the older data. A later start with local back must not bring the write
    # back: that start's beginning record is newer than local's longer history.
    cluster = make_cluster(volumes=(("vol0", "64MiB"),), ack={"far": "network-sync"}, host_extra=PATIENT)
    older, weak = random_bytes(4096, 71), random_bytes(4096, 72)
    with Client(cluster.uri()) as c:
        c.pwrite(older, 0)
        c.flush()
    cluster.wait_caught_up()
    assert harness.volume_status(cluster.status())["beginning"] is None, "held by Q at once"

    h = connected(cluster.uri())
    stopped(cluster, "near", "far")
    try:
        cookie = start_write(h, weak, 0)
        answered = completes_within(h, cookie, 5)
    finally:
        # Gone with what their sockets held: neither stores the write.
        cluster.kill_element("near")
        cluster.kill_element("far")
    assert answered, "local (durable) and far (network-sync) answer the write"
    h.shutdown()
    cluster.host.kill9()
    cluster.kill_element("local")

    # The first start: near and far only.
    cluster.restart_element("near")
    cluster.restart_element("far")
    cluster.start_host(ready=False)
    cluster.wait_status(
        lambda s: harness.volume_status(s)["mode"] == "read-write"
        and all(element_of(s, n)["state"] == "in-sync" for n in ("near", "far")),
        60,
        "the host element read-write with near and far",
    )
    with Client(cluster.uri()) as c:
        assert c.pread(4096, 0) == older, "a start without local does without the weak write"
    cluster.wait_status(lambda s: harness.volume_status(s)["beginning"] is None, 30, "the beginning held by Q")
    cluster.host.kill9()

    # The second start: local is back, holding the longer history of the older epoch.
    cluster.restart_element("local")
    cluster.start_host(ready=False)
    cluster.wait_healthy(timeout=120)
    with Client(cluster.uri()) as c:
        for _ in range(3):
            assert c.pread(4096, 0) == older, "the write the first start did without came back"
    status = cluster.status()
    assert element_of(status, "local")["last_recovery"] is not None, "local's diverged tail was recovered over"
    cluster.stop_host()
    for name in ("local", "near", "far"):
        cluster.kill_element(name, signal.SIGTERM)
    held = {
        name: {v["name"]: (v["applied_sequence"], v["digest"]) for v in cluster.elements[name].verify()["volumes"]}
        for name in ("local", "near", "far")
    }
    assert held["local"] == held["near"] == held["far"], f"replicas differ: {held}"
