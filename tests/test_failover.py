"""Failover with real processes (issue 12): a standby host element takes over,
by hand (`starfish failover`) or by itself through a real etcd.

- a graceful handover keeps every write and the NBD address (one machine);
- etcd: SIGTERM of the active lets the elements and the key go, the standby
  takes over and nothing is lost;
- kill -9 of the active, then `starfish failover`: fenced, nothing lost;
- etcd: kill -9 of the active under a recorded write load, judged by the
  simulator's checker (`sim check-history`);
- etcd: SIGSTOP of the active past its lease, a takeover, SIGCONT: its late
  write fails and its reads never return the overwritten data;
- etcd down: the active keeps serving and nobody takes over;
- qemu-io with `reconnect-delay` is never told: it goes on across a kill -9
  and an automatic takeover on the same address;
- a host element that takes the elements back from one that is gone (paused
  meanwhile, then SIGCONT) reads the catalog again: the volume the other one
  deleted stays deleted, the one it created is served with its data.

etcd is Debian's `etcd-server`, started by each test on 127.0.0.1 and
stopped by PID.
"""

import base64
import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

import harness
from browser import Browser
import history_recorder
from conftest import attach_logs, cluster_only, require_tools

MiB = harness.MiB


class Etcd:
    def __init__(self, workdir):
        self.client_port = harness.free_port()
        self.peer_port = harness.free_port()
        self.data = os.path.join(workdir, "etcd-data")
        self.process = harness.Process(
            "etcd",
            [
                "etcd",
                "--name", "starfish-test",
                "--data-dir", self.data,
                "--listen-client-urls", self.url,
                "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://{harness.LOCALHOST}:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://{harness.LOCALHOST}:{self.peer_port}",
                "--initial-cluster", f"starfish-test=http://{harness.LOCALHOST}:{self.peer_port}",
            ],
            os.path.join(workdir, "etcd.log"),
        )

    @property
    def url(self):
        return f"http://{harness.LOCALHOST}:{self.client_port}"

    def start(self):
        self.process.start()
        harness.wait_listening(self.process, self.client_port)

    def destroy(self):
        self.process.kill9()
        self.process.reap_group()

    def call(self, path, body):
        """POST to etcd's JSON gateway (`/v3/...`), keys and values base64."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    def lease_of(self, key):
        """The lease `key` is attached to (None: no such key, or none)."""
        kvs = self.call("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()}).get("kvs", [])
        return kvs[0].get("lease") if kvs else None

    def lease_ttl(self, lease):
        """Seconds left on `lease`; -1 once it is revoked or lapsed."""
        return int(self.call("/v3/lease/timetolive", {"ID": lease})["TTL"])


class FailoverCluster(harness.Cluster):
    """Three elements and two host elements, `a` and `b`; `b` (and `a` with etcd)
    starts as a standby. `same_nbd`: both use one NBD address (one machine)."""

    def __init__(self, workdir, etcd=None, same_nbd=True, **kwargs):
        super().__init__(workdir, **kwargs)
        self.etcd = etcd
        self.hosts = {}
        self.admins = {"a": self.admin_port, "b": harness.free_port()}
        self.nbds = {"a": self.nbd_port, "b": self.nbd_port if same_nbd else harness.free_port()}
        for name in ("a", "b"):
            args = self.host_args()
            args[args.index("--admin") + 1] = f"{harness.LOCALHOST}:{self.admins[name]}"
            args[args.index("--nbd") + 1] = f"{harness.LOCALHOST}:{self.nbds[name]}"
            if etcd is not None:
                args += ["--etcd", etcd.url]
            elif name == "b":
                args += ["--standby"]
            self.hosts[name] = harness.Process(f"host-{name}", args, os.path.join(workdir, f"host-{name}.log"))
        self.host = self.hosts["a"]

    def admin_of(self, name):
        return f"{harness.LOCALHOST}:{self.admins[name]}"

    def uri_of(self, name, volume="vol0"):
        if self.certs:
            admin = os.path.join(self.certs, "admin")
            return f"nbds://{harness.LOCALHOST}:{self.nbds[name]}/{volume}?tls-certificates={admin}"
        return f"nbd://{harness.LOCALHOST}:{self.nbds[name]}/{volume}"

    def admin_tls(self):
        """`--tls-dir` of the operator's certificate, with TLS."""
        return ["--tls-dir", os.path.join(self.certs, "admin")] if self.certs else []

    def start(self):
        for element in self.elements.values():
            element.start()
        self.hosts["a"].start()
        harness.wait_listening(self.hosts["a"], self.admins["a"])
        self.wait_role("a", "active")
        self.hosts["b"].start()
        harness.wait_listening(self.hosts["b"], self.admins["b"])
        self.wait_role("b", "standby", active_known=True)
        return self

    def status_of(self, name, timeout=harness.STATUS_TIMEOUT):
        result = harness.run(
            [harness.starfish_bin(), "status", "--admin", self.admin_of(name), "--json"], timeout=timeout
        )
        return json.loads(result.stdout)

    def wait_role(self, name, role, timeout=30, active_known=False, active_admin=None):
        def check():
            if not self.hosts[name].alive():
                raise AssertionError(f"host {name} exited: {self.hosts[name].log()}")
            s = self.status_of(name)
            if s["role"] != role:
                return None
            if role == "active" and not harness.healthy(s):
                return None
            if active_known and not s.get("active"):
                return None
            if active_admin is not None and (s.get("active") or {}).get("admin") != active_admin:
                return None
            return s

        return harness.wait_until(check, timeout, f"host {name} to be {role}", interval=0.05)

    def failover(self, name):
        result = harness.run(
            [harness.starfish_bin(), "failover", "--admin", self.admin_of(name), "--json", *self.admin_tls()],
            timeout=60,
        )
        return json.loads(result.stdout)

    def destroy(self):
        for process in self.hosts.values():
            process.kill9()
            process.reap_group()
        super().destroy()

    def logs(self, lines=150):
        parts = [(p.name, harness.tail_file(p.log_path, lines)) for p in self.hosts.values()]
        parts += [(e.process.name, harness.tail_file(e.process.log_path, lines)) for e in self.elements.values()]
        if self.etcd is not None:
            parts.append(("etcd", harness.tail_file(self.etcd.process.log_path, 40)))
        return parts


@pytest.fixture
def make_failover(request, workdir):
    cluster_only()
    request.getfixturevalue("starfish_bin")
    made = []

    def make(with_etcd=False, **kwargs):
        etcd = None
        if with_etcd:
            require_tools("etcd")
            etcd = Etcd(workdir)
            made.append(etcd)
            etcd.start()
        cluster = FailoverCluster(os.path.join(workdir, f"failover{len(made)}"), etcd=etcd, **kwargs)
        made.append(cluster)
        attach_logs(request, cluster)
        return cluster.start()

    os.makedirs(workdir, exist_ok=True)
    yield make
    for thing in reversed(made):
        thing.destroy()


def pattern(seed, length):
    return random.Random(seed).randbytes(length)


@pytest.mark.time_limit(120)
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_graceful_handover_keeps_every_write_and_the_nbd_address(make_failover, tls, workdir):
    # With TLS the standby asks the active one to drain with its host element certificate.
    c = make_failover(tls=tls)
    old_epoch = c.status_of("a")["epoch"]
    data = pattern(1, 4 * MiB)
    with harness.Client(c.uri_of("a")) as client:
        client.pwrite(data, 0)
    standby = c.status_of("b")
    assert standby["role"] == "standby" and standby["volumes"] == []
    assert standby["active"]["admin"] == c.admin_of("a"), standby

    with contextlib.ExitStack() as stack:
        # b's status page (plain run: one browser is enough) follows it from standby to active.
        page = None if tls else stack.enter_context(Browser(workdir))
        if page:
            page.open(f"http://{c.admin_of('b')}/")
            page.wait("document.getElementById('role').textContent === 'standby'", 15, "b a standby")
            page.wait("document.querySelectorAll('#elements tr[data-state=reachable]').length === 3", 10,
                      "the three elements reachable from the standby")
            assert c.admin_of("a") in page.eval("document.getElementById('note').textContent")
            page.eval("window.sameDocument = true")

        report = c.failover("b")
        assert report["drained"]["ok"] is True, report
        assert report["epoch"] > old_epoch
        assert report["ready_ms"] is not None, report
        print(f"graceful handover: every volume read-write after {report['ready_ms']} ms")

        s = c.wait_role("b", "active")
        assert s["epoch"] == report["epoch"]
        if page:
            page.wait(f"document.getElementById('role').textContent === 'active' && "
                      f"document.getElementById('epoch').textContent === '{report['epoch']}'", 10, "b active")
            page.wait("document.querySelector('#volumes tr[data-volume=vol0]')?.dataset.mode === 'read-write'", 10,
                      "vol0 read-write on b")
            assert page.eval("window.sameDocument === true"), "the page was reloaded"
    # a is a standby now, and sees b as the active one.
    c.wait_role("a", "standby", active_admin=c.admin_of("b"))
    # The same address, now served by b: the data is there, and writes go on.
    with harness.Client(c.uri_of("b")) as client:
        assert client.pread(len(data), 0) == data
        client.pwrite(pattern(2, MiB), 4 * MiB)
    # And back: a was drained into a standby, so it can take over again.
    report = c.failover("a")
    assert report["drained"]["ok"] is True, report
    with harness.Client(c.uri_of("a")) as client:
        assert client.pread(len(data), 0) == data
        assert client.pread(MiB, 4 * MiB) == pattern(2, MiB)


@pytest.mark.time_limit(120)
def test_a_stopped_active_host_element_lets_the_elements_go_and_the_standby_takes_over(make_failover):
    """SIGTERM of the active host element (etcd): it answers what it took, tells the elements
    it is gone (their read lease ends at once) and gives the etcd key up, so the standby takes
    over without waiting for either to lapse; nothing written is lost."""
    c = make_failover(with_etcd=True)
    epoch = c.status_of("a")["epoch"]
    lease = c.etcd.lease_of("/starfish/starfish/active")
    assert lease is not None and c.etcd.lease_ttl(lease) > 0, "a holds the active key under a live lease"
    data = pattern(3, 4 * MiB)
    with harness.Client(c.uri_of("a")) as client:
        client.pwrite(data, 0)
        client.flush()
    code, killed = c.hosts["a"].stop(signal.SIGTERM)
    assert (code, killed) == (0, False), c.hosts["a"].log()
    # Given up, not left to lapse (its keep-alives ran until the stop: seconds would be left).
    assert c.etcd.lease_ttl(lease) == -1, "the stopped host element's etcd lease is revoked"
    for name, element in c.elements.items():
        with open(element.process.log_path, errors="replace") as log:
            assert f"released epoch {epoch}" in log.read(), f"element {name} was not told the host element left"
    with open(c.hosts["a"].log_path, errors="replace") as log:
        text = log.read()
    assert "stopped and released" in text and "could not give the etcd key up" not in text, text[-3000:]
    s = c.wait_role("b", "active")
    assert s["epoch"] > epoch
    with harness.Client(c.uri_of("b")) as client:
        assert client.pread(len(data), 0) == data


@pytest.mark.time_limit(120)
def test_kill9_then_manual_failover_fences_and_keeps_acknowledged_writes(make_failover):
    c = make_failover()
    data = pattern(3, 2 * MiB)
    with harness.Client(c.uri_of("a")) as client:
        client.pwrite(data, 0)
        client.flush()
    c.hosts["a"].kill9()
    report = c.failover("b")
    assert report["drained"]["ok"] is False, report  # nobody to drain: fenced instead
    assert report["ready_ms"] is not None, report
    print(f"manual failover after kill -9: every volume read-write after {report['ready_ms']} ms")
    with harness.Client(c.uri_of("b")) as client:
        assert client.pread(len(data), 0) == data
    # A second failover request to an active host element is refused with a reason.
    result = harness.run([harness.starfish_bin(), "failover", "--admin", c.admin_of("b")], check=False, timeout=30)
    assert result.returncode != 0 and "already active" in (result.stderr + result.stdout), result


def sim_bin():
    return os.environ.get("SIM_BIN") or os.path.join(harness.REPO, "target", "release", "sim")


@pytest.mark.time_limit(180)
def test_etcd_takeover_of_a_killed_active_under_recorded_load(make_failover, workdir):
    checker = sim_bin()
    if not os.access(checker, os.X_OK):
        pytest.fail(f"the simulator's checker is not at {checker}", pytrace=False)
    volume_bytes = 64 * MiB
    c = make_failover(with_etcd=True, volumes=(("vol0", "64MiB"),))
    path = os.path.join(workdir, "failover-history.txt")
    history = history_recorder.History(path, volume_bytes)
    stop = threading.Event()
    seed = random.randrange(1 << 32)
    print(f"workload seed {seed}")
    workers = [history_recorder.Worker(history, c.uri_of("a"), seed * 16 + i, stop, depth=4) for i in range(2)]
    try:
        for w in workers:
            w.start()
        time.sleep(3)
        before = history.counts()[1]
        killed = time.monotonic()
        c.hosts["a"].kill9()
        c.wait_role("b", "active", timeout=20)
        takeover_s = time.monotonic() - killed
        time.sleep(3)
    finally:
        stop.set()
        for w in workers:
            w.join(70)
    assert not [w.name for w in workers if w.is_alive()], "workers did not stop"
    errors = [f"{w.name}: {w.error}" for w in workers if w.error]
    assert not errors, errors
    acked = history.counts()[1]
    assert before > 0 and acked > before, f"writes acknowledged before the kill {before}, in all {acked}"
    history_recorder.read_back(history, c.uri_of("b"), volume_bytes)
    history.save()
    history.close()
    result = harness.run([checker, "check-history", path, "--json"], timeout=120, check=False)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    print(
        f"kill -9 of the active under load: standby active and healthy {takeover_s:.2f} s later (status polling "
        f"included); {report['writes_acked']} writes acknowledged, {report['reads_checked']} reads checked, "
        f"violations {report['violations']}, lost {report['acked_writes_lost']}"
    )
    assert report["violations"] == 0, report["violation_messages"][:10]
    assert report["writes_acked"] > 0


@pytest.mark.time_limit(120)
def test_etcd_sigstop_past_the_lease_then_sigcont_late_writes_fail(make_failover):
    c = make_failover(with_etcd=True, same_nbd=False)
    old = pattern(5, 64 * 1024)
    new = pattern(6, 64 * 1024)
    late = pattern(7, 64 * 1024)
    with harness.Client(c.uri_of("a"), timeout=30) as frozen_side:
        frozen_side.pwrite(old, 0)
        frozen_side.pread(4096, 0)  # the read cache holds block 0
        c.hosts["a"].freeze()
        try:
            c.wait_role("b", "active", timeout=20)
            with harness.Client(c.uri_of("b")) as client:
                client.pwrite(new, 0)
        finally:
            c.hosts["a"].resume()
        # The old host element is fenced: a late write must fail, and a read of block 0 must
        # not return the data the new one overwrote.
        harness.expect_nbd_error(lambda: frozen_side.pwrite(late, 65536), {errno.EIO, errno.EPERM, errno.ENOTCONN,
                                 errno.ECONNRESET, errno.EPIPE, errno.ESHUTDOWN, errno.EINVAL}, "late write of the old host element")
        try:
            seen = frozen_side.pread(len(old), 0)
        except Exception as e:  # noqa: BLE001 - an error is a correct answer
            seen = e
        assert not (isinstance(seen, bytes) and seen == old), "the old host element answered with overwritten data"
    c.wait_role("a", "standby", timeout=30)
    with harness.Client(c.uri_of("b")) as client:
        assert client.pread(len(new), 0) == new
        assert client.pread(len(late), 65536) != late


@pytest.mark.time_limit(120)
def test_etcd_down_the_active_keeps_serving_and_nobody_takes_over(make_failover):
    c = make_failover(with_etcd=True)
    c.etcd.destroy()
    deadline = time.monotonic() + 6
    with harness.Client(c.uri_of("a")) as client:
        i = 0
        while time.monotonic() < deadline:
            block = pattern(100 + i, 65536)
            client.pwrite(block, i * 65536)
            assert client.pread(65536, i * 65536) == block
            i += 1
            time.sleep(0.05)
    assert c.status_of("a")["role"] == "active"
    assert c.status_of("b")["role"] == "standby"


def qemu_io_across(prefix, host, port, meanwhile, tls_dir=None):
    """qemu-io (reconnect-delay=30) writes 1 MiB, sleeps 4-5 s while `meanwhile()` runs
    (the failover), writes another, and reads both back; it must succeed, never told.
    With `tls_dir`, over TLS with that client certificate directory."""
    image = (
        f"driver=raw,file.driver=nbd,file.server.type=inet,file.server.host={host},"
        f"file.server.port={port},file.export=vol0,file.reconnect-delay=30"
    )
    tls = []
    if tls_dir:
        image += ",file.tls-creds=tls0"
        tls = ["--object", f"tls-creds-x509,id=tls0,endpoint=client,dir={tls_dir}"]
    commands = ["write -P 0xa1 0 1M", "sleep 5000", "write -P 0xb2 1M 1M", "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M"]
    args = prefix + ["qemu-io", *tls, "--image-opts", image]
    for command in commands:
        args += ["-c", command]
    qemu = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(1.5)
        meanwhile()
        out, _ = qemu.communicate(timeout=90)
    finally:
        if qemu.poll() is None:
            os.killpg(qemu.pid, signal.SIGKILL)
            qemu.wait(10)
    text = out.decode(errors="replace")
    assert qemu.returncode == 0, text
    assert "Pattern verification failed" not in text and "error" not in text.lower(), text
    assert text.count("bytes at offset") == 4, text


@pytest.mark.time_limit(120)
def test_qemu_io_with_reconnect_goes_on_across_an_automatic_takeover(make_failover):
    require_tools("qemu-io")
    c = make_failover(with_etcd=True)
    qemu_io_across([], harness.LOCALHOST, c.nbds["a"], c.hosts["a"].kill9)
    assert c.status_of("b")["role"] == "active"


class Namespaces:
    """A small routed network: `lan` (elements, etcd, the client) joined by a veth pair to
    each of `a` and `b` (one host element each). The floating NBD address lives on both
    host namespaces' loopback; `lan`'s route to it says which one gets the traffic — what a
    floating address (VRRP, a BGP-announced address) does between machines."""

    FLOATING = "10.77.1.100"

    def __init__(self):
        tag = f"sft{os.getpid() % 100000}"
        self.names = {side: f"{tag}-{side}" for side in ("lan", "a", "b")}
        self.lan_ip = {"a": "10.77.10.1", "b": "10.77.20.1"}
        self.host_ip = {"a": "10.77.10.2", "b": "10.77.20.2"}
        self.created = []

    def ip(self, *args):
        harness.run(["ip", *args], timeout=20)

    def create(self):
        for name in self.names.values():
            self.ip("netns", "add", name)
            self.created.append(name)
            self.ip("-n", name, "link", "set", "lo", "up")
        lan = self.names["lan"]
        for side in ("a", "b"):
            ns = self.names[side]
            outer, inner = f"v{side}l{os.getpid() % 10000}", f"v{side}h{os.getpid() % 10000}"
            self.ip("link", "add", outer, "netns", lan, "type", "veth", "peer", "name", inner, "netns", ns)
            self.ip("-n", lan, "addr", "add", f"{self.lan_ip[side]}/24", "dev", outer)
            self.ip("-n", lan, "link", "set", outer, "up")
            self.ip("-n", ns, "addr", "add", f"{self.host_ip[side]}/24", "dev", inner)
            self.ip("-n", ns, "link", "set", inner, "up")
            self.ip("-n", ns, "addr", "add", f"{self.FLOATING}/32", "dev", "lo")
            self.ip("-n", ns, "route", "add", "default", "via", self.lan_ip[side])
        self.point_floating_at("a")

    def point_floating_at(self, side):
        self.ip("-n", self.names["lan"], "route", "replace", f"{self.FLOATING}/32", "via", self.host_ip[side])

    def exec(self, side):
        return ["ip", "netns", "exec", self.names[side]]

    def destroy(self):
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


@pytest.mark.time_limit(150)
def test_floating_address_between_two_namespaces_qemu_io_never_told(request, workdir):
    """Two host elements in two network namespaces (two machines), elements, etcd and a
    qemu-io client in a third; the NBD address floats: after an automatic takeover the
    network routes it to the new active host element, and qemu-io (reconnect-delay) goes on."""
    cluster_only()
    request.getfixturevalue("starfish_bin")
    require_tools("qemu-io", "etcd", "ip")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    net = Namespaces()
    processes = []

    class Logs:
        def logs(self, lines=150):
            return [(p.name, harness.tail_file(p.log_path, lines)) for p in processes]

    attach_logs(request, Logs())

    def start(name, side, args):
        process = harness.Process(name, net.exec(side) + args, os.path.join(workdir, f"{name}.log"))
        processes.append(process)
        process.start()
        return process

    # Across machines the cluster runs as it should: mutual TLS, NBD over TLS (the hosts'
    # certificates name the floating address, which qemu checks).
    certs = os.path.join(workdir, "certs")
    harness.run([harness.starfish_bin(), "certs", "init", certs,
                 "--host", f"a={net.FLOATING}", f"b={net.FLOATING}",
                 "--element", *harness.ELEMENT_NAMES, "--client", "admin"], timeout=30)
    admin_tls = os.path.join(certs, "admin")

    def status(side):
        result = harness.run(
            net.exec("lan") + [harness.starfish_bin(), "status", "--json", "--admin", f"{net.host_ip[side]}:7100",
                               "--tls-dir", admin_tls],
            timeout=10,
        )
        return json.loads(result.stdout)

    def wait_role(side, role):
        def check():
            s = status(side)
            return s if s["role"] == role and (role != "active" or harness.healthy(s)) else None

        return harness.wait_until(check, 30, f"host {side} {role}", interval=0.1)

    def wait_tcp(side, address, port):
        def check():
            code = subprocess.run(
                net.exec(side) + ["bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}"], capture_output=True, timeout=5
            ).returncode
            return code == 0

        harness.wait_until(check, 30, f"{address}:{port} listening")

    try:
        net.create()
        lan = net.lan_ip["a"]
        etcd_url = f"http://{lan}:2379"
        start("etcd", "lan", ["etcd", "--name", "ns", "--data-dir", os.path.join(workdir, "etcd"),
                              "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                              "--listen-peer-urls", f"http://{lan}:2380",
                              "--initial-advertise-peer-urls", f"http://{lan}:2380",
                              "--initial-cluster", f"ns=http://{lan}:2380"])
        wait_tcp("lan", lan, 2379)
        element_flags = []
        for i, name in enumerate(harness.ELEMENT_NAMES):
            port = 7101 + i
            start(f"element-{name}", "lan", [harness.starfish_bin(), "element", "--listen", f"{lan}:{port}",
                                              "--data", os.path.join(workdir, f"element-{name}"),
                                              "--tls-dir", os.path.join(certs, name)])
            wait_tcp("lan", lan, port)
            element_flags += ["--element", f"{name}={lan}:{port}"]
        hosts = {}
        for side in ("a", "b"):
            hosts[side] = start(f"host-{side}", side, [harness.starfish_bin(), "host", "--nbd", f"{net.FLOATING}:10809",
                                                       "--admin", f"{net.host_ip[side]}:7100", *element_flags,
                                                       "--quorum", "2", "--volume", "vol0:256MiB", "--etcd", etcd_url,
                                                       "--tls-dir", os.path.join(certs, side)])
            wait_role(side, "active" if side == "a" else "standby")

        def fail_over():
            hosts["a"].kill9()
            wait_role("b", "active")
            net.point_floating_at("b")  # what VRRP or a routing daemon does

        qemu_io_across(net.exec("lan"), net.FLOATING, 10809, fail_over, tls_dir=admin_tls)
    finally:
        for process in processes:
            process.kill9()
            process.reap_group()
        net.destroy()


def volume_at(c, host, *args, check=True):
    result = harness.run([harness.starfish_bin(), "volume", *args, "--admin", c.admin_of(host), "--json"],
                         timeout=60, check=check)
    return json.loads(result.stdout) if check else result


def created_at(c, host):
    """The volumes created while running that `host` lists and does not delete."""
    volumes = volume_at(c, host, "list")["volumes"]
    return {v["name"] for v in volumes if v["origin"] == "created" and "deletion" not in v["state"]
            and not v["state"].startswith("deleting")}


def wait_writable(c, host, timeout=60):
    """`host` active with every volume read-write (some element may be down)."""
    def check():
        s = c.status_of(host)
        return s["role"] == "active" and s["volumes"] and all(v["mode"] == "read-write" for v in s["volumes"])

    harness.wait_until(check, timeout, f"host {host} active and read-write")


def listed_at(c, host):
    return {v["name"] for v in volume_at(c, host, "list")["volumes"]}


def exports_at(c, host):
    listing = harness.run(["nbdinfo", "--list", "--json", f"nbd://{harness.LOCALHOST}:{c.nbds[host]}"]).stdout
    return {e["export-name"] for e in json.loads(listing)["exports"]}


@pytest.mark.time_limit(180)
def test_a_host_element_that_takes_the_elements_back_reads_the_catalog_again(make_failover):
    """Host element a is paused; b takes over from the two other elements, deletes a volume a
    created, creates another and writes to it, and is killed. a runs again and, once the
    elements' owner is gone, takes them back (`Restarted`: local follows a's epoch, near b's):
    it must serve what the catalog says now, not what it read before its pause."""
    c = make_failover(same_nbd=False, volumes=(("vol0", "64MiB"),))
    volume_at(c, "a", "create", "old", "16MiB")
    assert "old" in exports_at(c, "a")
    # local goes down while a still runs: it keeps a's epoch (and the volume old).
    c.kill_element("local")
    a = c.hosts["a"]
    # b runs as a host element of its own, not a standby told to take over: a takeover would
    # ask a (paused) to drain, and a would carry out that request when it runs again.
    b = c.hosts["b"]
    b.stop()
    b.args = [arg for arg in b.args if arg != "--standby"]
    a.freeze()
    try:
        b.start()
        harness.wait_listening(b, c.admins["b"])
        wait_writable(c, "b")
        volume_at(c, "b", "delete", "old")
        volume_at(c, "b", "create", "new", "16MiB")
        data = pattern(11, 256 * 1024)
        with harness.Client(c.uri_of("b", "new")) as client:
            client.pwrite(data, 1 * MiB)
            client.flush()
        assert created_at(c, "b") == {"new"}
        c.hosts["b"].kill9()
        # The elements' owner must be gone for two heartbeat timeouts (3 s each) before a
        # host element takes them back.
        time.sleep(7)
        # near and far say nothing yet; local comes back following a's epoch.
        c.elements["near"].process.freeze()
        c.elements["far"].process.freeze()
        c.restart_element("local")
    finally:
        a.resume()
    try:
        # a welcomes local (it redials at least every 2 s), then hears from near that it
        # follows b's epoch, whose owner is gone: local (ours) and near (owner gone) are a
        # majority, and only near follows a newer epoch (not a majority: a is not superseded),
        # so a takes them back.
        time.sleep(4)
    finally:
        c.elements["near"].process.resume()
    try:
        harness.wait_until(lambda: "taking the elements back" in a.log(400) or None, 30,
                           "a to take the elements back")
    finally:
        c.elements["far"].process.resume()
    seen = []

    def active_and_healthy():
        seen[:] = [c.status_of("a")]
        return seen[0]["role"] == "active" and harness.healthy(seen[0])

    try:
        harness.wait_until(active_and_healthy, 60, "a active and healthy")
    except AssertionError as e:
        raise AssertionError(f"{e}: {json.dumps(seen, indent=1)[:3000]}") from None
    # What b did stands: old is gone, new is served with the data b acknowledged.
    harness.wait_until(lambda: created_at(c, "a") == {"new"} or None, 60, "a to list what the catalog holds now")
    # local, down while b deleted old, learns it from a's hello: the deletion completes.
    harness.wait_until(lambda: "old" not in listed_at(c, "a") or None, 60, "the deletion of old to complete")
    harness.wait_until(lambda: "new" in exports_at(c, "a") or None, 30, "a to export new")
    assert "old" not in exports_at(c, "a")
    with harness.Client(c.uri_of("a", "new")) as client:
        assert client.pread(len(data), 1 * MiB) == data
    assert "reading the catalog again" in a.log(400)
    # Every element, local too, holds new and not old.
    assert not c.stop(), "every process stops cleanly"
    for name, element in c.elements.items():
        held = [v["name"] for v in element.verify()["volumes"]]
        assert any(h.startswith("new#") for h in held) and not any(h.startswith("old#") for h in held), (name, held)
