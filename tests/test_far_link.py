"""The far link (issue 14): a far element reached over UDP with FEC (`--element
far=ADDR,fec=8:3,rate=…`), with real processes. Behind an emulated WAN path (`starfish link
--netns`: 50 ms one way, 1 % random loss, 100 Mbit/s) the far element keeps up with the
writes and holds what the others hold; the link also carries TLS; strangers' datagrams on an
element's UDP port are refused and change nothing."""

import os
import re
import socket
import subprocess
import time

import pytest

import harness
from harness import Client, random_bytes

MiB = 1024 * 1024


class NetnsLink:
    """`starfish link --netns --root-end`: end A is this (root) namespace, end B a namespace
    of its own where the far element runs; `set`, `cut`, `heal` go to its stdin."""

    def __init__(self, workdir, delay_ms, loss_pct, rate_mbit, duration_s=600):
        self.log_path = os.path.join(workdir, "link.log")
        self.args = [harness.starfish_bin(), "link", "--netns", "--root-end", "--delay-ms", str(delay_ms),
                     "--loss", str(loss_pct), "--rate-mbit", str(rate_mbit), "--duration", str(duration_s)]
        self.popen = None
        self.namespace = None
        self.address = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

        def up():
            match = re.search(r"end B: (\S+) in namespace (\S+)", harness.tail_file(self.log_path))
            if self.popen.poll() is not None:
                raise AssertionError(f"starfish link exited:\n{harness.tail_file(self.log_path)}")
            return match

        match = harness.wait_until(up, 30, "the emulated link up")
        self.address, self.namespace = match.group(1), match.group(2)
        return self

    def command(self, line):
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()

    def destroy(self):
        if self.popen and self.popen.poll() is None:
            # SIGTERM: the link tears its namespaces down.
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)

    def logs(self, lines=50):
        return [("link", harness.tail_file(self.log_path, lines))]


@pytest.fixture
def netns_link(request, workdir):
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("the emulated WAN link needs root and /dev/net/tun")
    links = []

    def make(**kwargs):
        link = NetnsLink(workdir, **kwargs).start()
        links.append(link)
        request.node._starfish_log_sources = getattr(request.node, "_starfish_log_sources", []) + [link]
        return link

    yield make
    for link in links:
        link.destroy()


def place_far_element_behind(cluster, link):
    """Run the cluster's far element inside the link's namespace, on end B's address."""
    far = cluster.elements["far"]
    address = f"{link.address}:{far.port}"
    far.process.args = ["ip", "netns", "exec", link.namespace] + far.process.args
    far.process.args[far.process.args.index("--listen") + 1] = address
    # Not loopback: the element wants TLS or --insecure (the namespace is ours alone).
    far.process.args.append("--insecure")
    cluster.addresses["far"] = address
    cluster.host = harness.Process("host", cluster.host_args(), cluster.host.log_path)
    return address


def start_far_behind(cluster, far_address):
    """Start the elements (the far one through its namespace) and the host element."""
    for name, element in cluster.elements.items():
        if name != "far":
            element.start()
    cluster.elements["far"].process.start()
    host, port = far_address.rsplit(":", 1)

    def reachable():
        if not cluster.elements["far"].process.alive():
            raise AssertionError(f"far element exited:\n{cluster.elements['far'].process.log()}")
        with socket.create_connection((host, int(port)), timeout=2):
            return True

    harness.wait_until(reachable, 30, "the far element listening behind the link")
    cluster.start_host()


def element_digests(cluster, name):
    return {v["name"]: (v["applied_sequence"], v["digest"]) for v in cluster.elements[name].verify()["volumes"]}


@pytest.mark.time_limit(240)
def test_a_far_element_behind_a_lossy_long_link_keeps_up(make_cluster, netns_link):
    link = netns_link(delay_ms=50, loss_pct=1, rate_mbit=100)
    cluster = make_cluster(start=False, volumes=(("vol0", "256MiB"),), ack={"far": "network-sync"},
                           far_links={"far": ("8:3", "90Mbit")})
    far_address = place_far_element_behind(cluster, link)
    start_far_behind(cluster, far_address)
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

    def caught_up(status):
        volume = harness.volume_status(status)
        far = next(e for e in status["elements"] if e["name"] == "far")
        return far["state"] == "in-sync" and far["applied_sequence"]["vol0"] == volume["acked_sequence"]

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
    status = cluster.wait_healthy(timeout=30)
    entry = next(e for e in status["elements"] if e["name"] == "far")
    assert entry["link"] == "udp-fec r=8 c=3 unpaced", entry
    assert far.process.alive()
    assert "datagram refused" in harness.tail_file(far.process.log_path, 400)
    assert cluster.stop() == []
    assert element_digests(cluster, "far") == element_digests(cluster, "local")
