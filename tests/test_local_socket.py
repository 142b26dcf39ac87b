"""The local socket: an element listening on a loopback address is reached from the same
machine over a Unix socket in the abstract namespace named after that address, and over TCP
when it has none or the host element is told not to use it. Either way the data is the same,
and a stranger on the local socket is dropped as one on the TCP port is."""

import socket

import pytest

import harness
from harness import MiB, Client


def links(status):
    return {e["name"]: e["link"] for e in status["elements"]}


def local_socket_name(element):
    # The abstract name (a leading NUL byte) an element takes for its loopback address.
    return "\0starfish-element@" + element.address


@pytest.mark.time_limit(180)
def test_elements_on_loopback_are_reached_over_their_local_socket_and_over_tcp_without_it(make_cluster):
    cluster = make_cluster()
    assert links(cluster.status()) == {name: "local socket" for name in harness.ELEMENT_NAMES}
    first = harness.random_bytes(1 * MiB, seed=1)
    with Client(cluster.uri()) as client:
        client.pwrite(first, 0)
        client.flush()

    # The near element comes back without a local socket: the host element reaches it over
    # TCP, and it catches up.
    near = cluster.elements["near"]
    cluster.kill_element("near")
    near.process.args = near.process.args + ["--no-local-socket"]
    second = harness.random_bytes(1 * MiB, seed=2)
    with Client(cluster.uri()) as client:
        client.pwrite(second, 8 * MiB)
        client.flush()
    cluster.restart_element("near")
    cluster.wait_caught_up()
    cluster.wait_status(lambda s: links(s)["near"] == "tcp", 30, "near reached over TCP")
    assert links(cluster.status()) == {"local": "local socket", "near": "tcp", "far": "local socket"}
    assert "element reached over tcp" in cluster.host.log(400)

    with Client(cluster.uri()) as client:
        assert client.pread(len(first), 0) == first
        assert client.pread(len(second), 8 * MiB) == second
    # The copies reached over either way are the same, byte for byte.
    complaints = cluster.stop()
    assert not complaints, complaints
    digests = {name: {v["name"]: v["digest"] for v in element.verify()["volumes"]}
               for name, element in cluster.elements.items()}
    assert len({tuple(sorted(d.items())) for d in digests.values()}) == 1, f"replicas differ: {digests}"


@pytest.mark.time_limit(120)
def test_a_stranger_on_the_local_socket_is_dropped_and_nothing_else_is_disturbed(cluster):
    local = cluster.elements["local"]
    data = harness.random_bytes(256 * 1024, seed=3)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        strangers = []
        for seed in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(20)
            sock.connect(local_socket_name(local))
            # A frame header announcing a body that is no message, then the body.
            sock.sendall(b"\xff" * 8 + harness.random_bytes(4096, seed=seed))
            strangers.append(sock)
        for sock in strangers:
            harness.assert_dropped(sock, "the element kept a stranger's local connection open")
        assert local.process.alive()
        assert client.pread(len(data), 0) == data
    assert "local socket" in harness.tail_file(local.process.log_path, 300)
    cluster.wait_healthy()
    assert links(cluster.status())["local"] == "local socket"


@pytest.mark.time_limit(120)
def test_a_host_element_told_no_local_socket_reaches_every_element_over_tcp(make_cluster):
    cluster = make_cluster(host_extra=["--no-local-socket"])
    assert links(cluster.status()) == {name: "tcp" for name in harness.ELEMENT_NAMES}
    data = harness.random_bytes(1 * MiB, seed=4)
    with Client(cluster.uri()) as client:
        client.pwrite(data, 0)
        assert client.pread(len(data), 0) == data


@pytest.mark.time_limit(60)
def test_an_element_whose_local_socket_is_taken_refuses_to_start_with_the_reason(workdir):
    # Were it to serve without its local socket, host elements on this machine would reach
    # whoever holds the name instead of it.
    port = harness.free_port()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        squatter.bind(f"\0starfish-element@{harness.LOCALHOST}:{port}")
        squatter.listen(1)
        result = harness.run([harness.starfish_bin(), "element", "--listen", f"{harness.LOCALHOST}:{port}",
                              "--data", f"{workdir}/element"], timeout=30, check=False)
        assert result.returncode != 0, "the element started with its local socket taken"
        assert f"cannot listen on the local socket @starfish-element@{harness.LOCALHOST}:{port}" in result.stderr, \
            result.stderr
    finally:
        squatter.close()
