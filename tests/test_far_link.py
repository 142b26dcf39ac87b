"""The far link (issue 14): a far element reached over UDP with FEC (`--element
far=ADDR,fec=8:3,rate=…`), with real processes. Behind an emulated WAN path (`starfish link
--netns`: 50 ms one way, 1 % random loss, 100 Mbit/s) the far element keeps up with the
writes and holds what the others hold; the link also carries TLS; strangers' datagrams on an
element's UDP port are refused and change nothing."""

import os
import socket
import time

import pytest

import harness
from harness import Client, random_bytes

MiB = 1024 * 1024


def caught_up(status):
    volume = harness.volume_status(status)
    far = next(e for e in status["elements"] if e["name"] == "far")
    return far["state"] == "in-sync" and far["applied_sequence"]["vol0"] == volume["acked_sequence"]


def element_digests(cluster, name):
    return {v["name"]: (v["applied_sequence"], v["digest"]) for v in cluster.elements[name].verify()["volumes"]}


@pytest.mark.time_limit(240)
def test_a_far_element_behind_a_lossy_long_link_keeps_up(make_cluster, netns_link):
    link = netns_link(delay_ms=50, loss_pct=1, rate_mbit=100)
    cluster = make_cluster(start=False, volumes=(("vol0", "256MiB"),), ack={"far": "network-sync"},
                           far_links={"far": ("8:3", "90Mbit")})
    far_address = harness.place_far_element_behind(cluster, link)
    harness.start_far_behind(cluster, far_address)
    status = cluster.status()
    far = next(e for e in status["elements"] if e["name"] == "far")
    assert far["link"].startswith("udp-fec r=8 c=3"), far
    assert far["rtt_ms"] is None or far["rtt_ms"] >= 100, f"the far element is behind the 2 × 50 ms path: {far}"

    size = 48 * MiB
    data = random_bytes(size, 14)
    started = time.monotonic()
    with Client(cluster.uri(), timeout=120) as c:
        for offset in range(0, size, MiB):
            c.pwrite(data[offset:offset + MiB], offset)
        c.flush()
    written_s = time.monotonic() - started

    cluster.wait_status(caught_up, 60, "the far element caught up with every acknowledged write")
    caught_up_s = time.monotonic() - started
    print(f"far link 50 ms one way, 1 % loss, 100 Mbit/s: {size / MiB:.0f} MiB written in {written_s:.1f} s, "
          f"far caught up after {caught_up_s:.1f} s ({size * 8 / caught_up_s / 1e6:.1f} Mbit/s to the far site)")
    host_log = harness.tail_file(cluster.host.log_path, 400)
    assert "far" not in "".join(line for line in host_log.splitlines() if "session ended" in line), \
        f"the far element's session held through the loss:\n{host_log}"
    with Client(cluster.uri()) as c:
        for offset in range(0, size, 8 * MiB):
            assert c.pread(8 * MiB, offset) == data[offset:offset + 8 * MiB], f"content at {offset}"
    assert cluster.stop() == []
    assert element_digests(cluster, "far") == element_digests(cluster, "local")


@pytest.mark.time_limit(120)
def test_the_far_link_carries_tls_and_refuses_strangers(make_cluster):
    cluster = make_cluster(volumes=(("vol0", "64MiB"),), tls=True, ack={"far": "network-sync"},
                           far_links={"far": ("8:3", None)})
    far = cluster.elements["far"]
    # Strangers on the far element's UDP port: junk, a truncated datagram, an HTTP request.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for junk in [b"", b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", os.urandom(1400)]:
            s.sendto(junk, (harness.LOCALHOST, far.port))
    data = random_bytes(8 * MiB, 15)
    with Client(cluster.uri(), timeout=60) as c:
        c.pwrite(data, 0)
        c.flush()
        assert c.pread(len(data), 0) == data
    # network-sync counted the far element once the write was on the wire; it applies it soon
    # after.
    status = cluster.wait_status(caught_up, 30, "the far element applied every acknowledged write")
    entry = next(e for e in status["elements"] if e["name"] == "far")
    assert entry["link"] == "udp-fec r=8 c=3 unpaced", entry
    assert far.process.alive()
    assert "datagram refused" in harness.tail_file(far.process.log_path, 400)
    assert cluster.stop() == []
    assert element_digests(cluster, "far") == element_digests(cluster, "local")
