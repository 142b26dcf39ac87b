"""Mutual TLS: a cluster started with certificates serves real NBD clients over TLS only, and
refuses everyone else at every door — strangers without a certificate, certificates of another
CA, expired ones, and a certificate of one role trying to do what only another may — while
it keeps serving and nothing of theirs is written."""

import json
import os
import socket
import ssl
import struct
import subprocess

import pytest

import harness
from conftest import require_tools
from history_recorder import crc32c
from harness import Client, run

U64_MAX = (1 << 64) - 1


# -- the element wire protocol, just enough to knock on an element's door ---------------------


def text(value):
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def frame(body):
    return struct.pack("<II", len(body), crc32c(body)) + body


# proto::WIRE_VERSION: first in a hello, after its tag.
WIRE_VERSION = 2


def hello(epoch, host, volumes=(("vol0", 1 << 30),), version=WIRE_VERSION):
    body = struct.pack("<BHQQI", 1, version, epoch, host, len(volumes))
    for name, size in volumes:
        # A volume spec: name, size, and 0 (not a clone).
        body += text(name) + struct.pack("<QB", size, 0)
    # No admin address; flags 0 (no receipt acknowledgements).
    return frame(body + text("") + b"\x00")


def apply_write(epoch, sequence, data, offset=0):
    """An `Apply` of a block-aligned write, with the crc32c of each 4 KiB piece after the data."""
    assert offset % 4096 == 0 and len(data) % 4096 == 0
    crcs = [crc32c(data[i:i + 4096]) for i in range(0, len(data), 4096)]
    body = struct.pack("<BIQQBQI", 2, 0, epoch, sequence, 1, offset, len(data)) + data
    body += struct.pack(f"<I{len(crcs)}I", len(crcs), *crcs)
    return frame(body)


def read_frame(sock):
    """The next frame's body, or None if the connection ended (or TLS failed) first."""

    def exactly(n):
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                return None
            out += chunk
        return out

    try:
        header = exactly(8)
        if header is None:
            return None
        length, _ = struct.unpack("<II", header)
        return exactly(length)
    except (ssl.SSLError, ConnectionError, socket.timeout, OSError):
        return None


def refusal_reason(body):
    """The reason of a `Refused` frame."""
    assert body is not None and body[0] == 2, f"expected a refusal, got {body[:32] if body else body!r}"
    (length,) = struct.unpack("<I", body[1:5])
    return body[5 : 5 + length].decode()


def connect(address, certs_dir=None, ca=None, plain=False):
    """A socket to `address`: plain, or TLS presenting `certs_dir`'s certificate (none if
    None). The server's certificate is not checked here: the server's refusal is the test."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    if plain:
        return sock
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if certs_dir:
        for cert, key in (("cert.pem", "key.pem"), ("client-cert.pem", "client-key.pem")):
            if os.path.exists(os.path.join(certs_dir, cert)):
                context.load_cert_chain(os.path.join(certs_dir, cert), os.path.join(certs_dir, key))
    return context.wrap_socket(sock)


def knock(address, message, **how):
    """Send `message` and return the first frame answered (None: closed, no answer)."""
    try:
        sock = connect(address, **how)
    except (ssl.SSLError, ConnectionError, OSError):
        return None
    try:
        sock.sendall(message)
        return read_frame(sock)
    except (ssl.SSLError, ConnectionError, OSError):
        return None
    finally:
        sock.close()


# -- tests --------------------------------------------------------------------------------------


def make_certs(directory, *args):
    run([harness.starfish_bin(), "certs", "init", directory, *args], timeout=60)


@pytest.mark.time_limit(240)
def test_tls_cluster_serves_real_nbd_clients_over_tls_only(make_cluster, workdir):
    require_tools("nbdinfo", "qemu-io", "qemu-img", "fio")
    cluster = make_cluster(tls=True)
    admin = os.path.join(cluster.certs, "admin")
    info = json.loads(run(["nbdinfo", "--json", cluster.uri()], timeout=30).stdout)
    assert info["protocol"] == "newstyle-fixed" and info["TLS"] is True, info
    assert info["exports"][0]["export-size"] == 1 << 30

    creds = ["--object", f"tls-creds-x509,id=tls0,endpoint=client,dir={admin}"]
    image = f"driver=raw,file.driver=nbd,file.host={harness.LOCALHOST},file.port={cluster.nbd_port},file.export=vol0,file.tls-creds=tls0"
    out = run(["qemu-io", *creds, "--image-opts", image, "-c", "write -P 0x5a 0 1M", "-c", "read -P 0x5a 0 1M"],
              timeout=60).stdout
    assert "Pattern verification failed" not in out and out.count("bytes at offset") == 2, out

    source = os.path.join(workdir, "image.raw")
    with open(source, "wb") as f:
        f.write(harness.random_bytes(4 << 20, seed=7))
    run(["qemu-img", "convert", "-n", *creds, "-f", "raw", source, "--target-image-opts", image], timeout=60)
    with Client(cluster.uri()) as client:
        assert client.pread(4 << 20, 0) == open(source, "rb").read()

    # fio's nbd engine (libnbd) refuses certificate paths in its URI, so it finds them where
    # libnbd looks by default: $HOME/.pki/libnbd for a user that is not root (a user namespace
    # makes fio one; the copies are readable to it).
    home = os.path.join(workdir, "home")
    pki = os.path.join(home, ".pki", "libnbd")
    os.makedirs(pki)
    for name in ("ca-cert.pem", "client-cert.pem", "client-key.pem"):
        with open(os.path.join(admin, name), "rb") as src, open(os.path.join(pki, name), "wb") as dst:
            dst.write(src.read())
        os.chmod(os.path.join(pki, name), 0o644)
    for directory in (workdir, home, os.path.dirname(pki), pki):
        os.chmod(directory, 0o755)
    job = subprocess.run(
        ["unshare", "--user", "fio", "--name=tls", "--ioengine=nbd", f"--uri=nbds://{cluster.nbd_address}/vol0",
         "--rw=randwrite", "--bs=4k", "--size=16M", "--io_size=4M", "--iodepth=8", "--verify=crc32c",
         "--output-format=json"],
        # fio saves its verify state in its working directory: the test's, not the repository.
        capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": home}, cwd=workdir,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert json.loads(job.stdout[job.stdout.index("{") :])["jobs"][0]["error"] == 0, job.stdout

    # A plain client is told TLS is required, and gets nothing.
    plain = subprocess.run(["qemu-io", "-f", "raw", "-c", "read 0 4k", f"nbd://{cluster.nbd_address}/vol0"],
                           capture_output=True, text=True, timeout=30)
    assert plain.returncode != 0 and "requires TLS" in plain.stdout + plain.stderr, plain.stdout + plain.stderr
    plain = subprocess.run(["nbdinfo", f"nbd://{cluster.nbd_address}/vol0"], capture_output=True, text=True,
                           timeout=30)
    assert plain.returncode != 0

    # A certificate of another CA is refused by the server.
    other = os.path.join(workdir, "other-ca")
    make_certs(other, "--client", "admin")
    foreign = subprocess.run(
        ["nbdinfo", f"nbds://{cluster.nbd_address}/vol0?tls-certificates={os.path.join(other, 'admin')}"],
        capture_output=True, text=True, timeout=30,
    )
    assert foreign.returncode != 0


@pytest.mark.time_limit(240)
def test_nbd_tls_verify_peer_needs_a_client_certificate_of_the_cluster(make_cluster, workdir):
    require_tools("nbdinfo", "nbdsh")
    cluster = make_cluster(tls=True, host_extra=["--nbd-tls-verify-peer"])
    # A client and an operator certificate are both accepted.
    for name in ("nbdclient", "admin"):
        run(["nbdinfo", cluster.uri(certificates=name)], timeout=30)
    # Only the CA, no certificate of its own: refused.
    anonymous = os.path.join(workdir, "anonymous")
    os.makedirs(anonymous)
    with open(os.path.join(cluster.certs, "admin", "ca-cert.pem"), "rb") as src:
        with open(os.path.join(anonymous, "ca-cert.pem"), "wb") as dst:
            dst.write(src.read())
    refused = subprocess.run(["nbdinfo", f"nbds://{cluster.nbd_address}/vol0?tls-certificates={anonymous}"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0, refused.stdout
    # An element's certificate may not use NBD (copied under the names libnbd looks for).
    impostor = os.path.join(workdir, "impostor")
    os.makedirs(impostor)
    near = os.path.join(cluster.certs, "near")
    for source, target in (("ca-cert.pem", "ca-cert.pem"), ("cert.pem", "client-cert.pem"), ("key.pem", "client-key.pem")):
        with open(os.path.join(near, source), "rb") as src, open(os.path.join(impostor, target), "wb") as dst:
            dst.write(src.read())
    refused = subprocess.run(["nbdinfo", f"nbds://{cluster.nbd_address}/vol0?tls-certificates={impostor}"],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0, refused.stdout
    harness.wait_until(lambda: "may not use NBD" in harness.tail_file(cluster.host.log_path, 200), 10,
                       "the host element to log why it refused an element's certificate")
    assert cluster.host.alive()


@pytest.mark.time_limit(240)
def test_strangers_and_wrong_roles_are_refused_at_the_element_and_nothing_is_written(make_cluster, workdir):
    cluster = make_cluster(tls=True)
    with Client(cluster.uri()) as client:
        client.pwrite(b"\x11" * 65536, 0)
        client.flush()
    before = cluster.status()
    epoch, host_id = before["epoch"], int(before["host_id"], 16)
    near = cluster.elements["near"]
    certs = cluster.certs

    # Another CA's host element, an expired certificate of ours, an NBD client's certificate.
    other = os.path.join(workdir, "other-ca")
    make_certs(other, "--host", "host")
    run([harness.starfish_bin(), "certs", "add", certs, "--host", "old-host", "--not-after", "2020-01-01"],
        timeout=60)

    attacks = {
        "plain TCP": dict(plain=True),
        "TLS without a certificate": dict(certs_dir=None),
        "a certificate of another CA": dict(certs_dir=os.path.join(other, "host")),
        "an expired certificate": dict(certs_dir=os.path.join(certs, "old-host")),
        "an NBD client's certificate": dict(certs_dir=os.path.join(certs, "nbdclient")),
        "an operator's certificate": dict(certs_dir=os.path.join(certs, "admin")),
    }
    for what, how in attacks.items():
        # The hello that would fence every host element forever, were it welcomed.
        answer = knock(near.address, hello(U64_MAX, 7), **how)
        assert answer is None, f"{what}: the element answered {answer[:40]!r}"

    # An element's own certificate may fetch from a peer, never set epochs or write.
    element = os.path.join(certs, "far")
    reason = refusal_reason(knock(near.address, hello(U64_MAX, 7), certs_dir=element))
    assert "may not set epochs" in reason, reason
    sock = connect(near.address, certs_dir=element)
    try:
        sock.sendall(hello(epoch, host_id))
        welcome = read_frame(sock)
        assert welcome is not None and welcome[0] == 1, f"a peer's hello at the current epoch: {welcome!r}"
        sock.sendall(apply_write(epoch, before["volumes"][0]["acked_sequence"] + 1, b"\xee" * 4096))
        reason = refusal_reason(read_frame(sock))
        assert "may not send a write" in reason, reason
    finally:
        sock.close()

    log = harness.tail_file(near.process.log_path, 400)
    assert "expired" in log, "no log line says the certificate had expired"
    assert "not signed by this cluster's CA" in log or "UnknownIssuer" in log, log[-3000:]
    assert "may not speak to an element" in log

    # The cluster kept serving, at the same epoch, with the data it had.
    after = cluster.wait_healthy()
    assert after["epoch"] == epoch
    with Client(cluster.uri()) as client:
        assert client.pread(65536, 0) == b"\x11" * 65536
        client.pwrite(b"\x22" * 4096, 65536)
        client.flush()
    assert not cluster.stop()
    digests = {name: e.verify()["volumes"][0]["digest"] for name, e in cluster.elements.items()}
    assert len(set(digests.values())) == 1, f"replicas differ after the attempts: {digests}"


@pytest.mark.time_limit(120)
def test_a_host_element_of_another_wire_version_is_refused_with_the_reason(cluster):
    """A hello of another wire version (a host element of another StarFish release) is refused
    with both versions named, before anything of it is acted on, and so is a standby's observe;
    the cluster serves on."""
    near = cluster.elements["near"]
    epoch = cluster.status()["epoch"]
    for version in (WIRE_VERSION + 1, 0):
        reason = refusal_reason(knock(near.address, hello(epoch + 5, 7, version=version), plain=True))
        assert f"wire version {version}" in reason and f"this side version {WIRE_VERSION}" in reason, reason
    # A standby's question, which needs no session, carries the version too.
    observed = knock(near.address, frame(struct.pack("<BHQ", 10, WIRE_VERSION, 1)), plain=True)
    assert observed is not None and observed[0] == 13, f"an observe of our version: {observed!r}"
    reason = refusal_reason(knock(near.address, frame(struct.pack("<BHQ", 10, WIRE_VERSION + 1, 1)), plain=True))
    assert f"wire version {WIRE_VERSION + 1} (in its observe)" in reason, reason
    log = harness.tail_file(near.process.log_path, 200)
    assert f"wire version {WIRE_VERSION + 1}" in log, log[-2000:]
    status = cluster.wait_healthy()
    assert status["epoch"] == epoch, "the refused hello's epoch was not taken"
    with Client(cluster.uri()) as client:
        client.pwrite(b"\x33" * 4096, 0)
        assert client.pread(4096, 0) == b"\x33" * 4096


@pytest.mark.time_limit(180)
def test_admin_orders_need_an_admin_certificate(make_cluster):
    cluster = make_cluster(tls=True)

    def failover(*extra):
        return subprocess.run([harness.starfish_bin(), "failover", "--admin", cluster.admin, *extra],
                              capture_output=True, text=True, timeout=30)

    refused = failover()
    assert refused.returncode != 0 and "403" in refused.stderr and "admin certificate" in refused.stderr, refused.stderr
    refused = failover("--tls-dir", os.path.join(cluster.certs, "nbdclient"))
    assert refused.returncode != 0 and "403" in refused.stderr and "may not give orders" in refused.stderr, \
        refused.stderr
    # The operator's certificate gets through to the order itself (refused for its own reason:
    # this host element is the active one already).
    allowed = failover("--tls-dir", os.path.join(cluster.certs, "admin"))
    assert allowed.returncode != 0 and "already active" in allowed.stderr, allowed.stderr
    # Reads stay open on loopback, in the clear and over TLS.
    assert cluster.status()["role"] == "active"
    status = run([harness.starfish_bin(), "status", "--json", "--admin", cluster.admin, "--tls-dir",
                  os.path.join(cluster.certs, "nbdclient")], timeout=30)
    assert json.loads(status.stdout)["role"] == "active"


@pytest.mark.time_limit(60)
def test_plain_tcp_beyond_loopback_is_refused_unless_insecure(workdir):
    data = os.path.join(workdir, "data")
    # 192.0.2.0/24 is TEST-NET-1: never this machine's, so --insecure then fails to bind.
    refused = subprocess.run([harness.starfish_bin(), "element", "--listen", "192.0.2.1:7101", "--data", data],
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "without TLS" in refused.stderr and "--insecure" in refused.stderr, \
        refused.stderr
    insecure = subprocess.run([harness.starfish_bin(), "element", "--listen", "192.0.2.1:7101", "--data", data,
                               "--insecure"], capture_output=True, text=True, timeout=30)
    assert insecure.returncode != 0 and "without TLS" not in insecure.stderr and "cannot listen" in insecure.stderr, \
        insecure.stderr
    host = subprocess.run([harness.starfish_bin(), "host", "--nbd", "192.0.2.1:10809", "--admin", "127.0.0.1:1",
                           "--element", "a=127.0.0.1:2", "--volume", "v:1MiB"],
                          capture_output=True, text=True, timeout=30)
    assert host.returncode != 0 and "refusing to serve NBD" in host.stderr, host.stderr
