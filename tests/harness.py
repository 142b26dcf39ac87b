"""Process harness for the real-process tests: ports, subprocesses with logs,
a StarFish cluster (three elements and a host), an NBD client whose every
operation is bounded in time, and data patterns that describe themselves.

Everything here stops what it starts by PID and never waits without a bound.
"""

import errno
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request

import nbd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCALHOST = "127.0.0.1"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# Bounds on waiting, in seconds. Generous: CI machines are small and busy.
START_TIMEOUT = 30.0
STATUS_TIMEOUT = 10.0
STOP_TIMEOUT = 20.0
NBD_OP_TIMEOUT = 60.0

ELEMENT_NAMES = ("local", "near", "far")


def starfish_bin():
    return os.environ.get("STARFISH_BIN") or os.path.join(REPO, "target", "release", "starfish")


def reference_mode():
    """STARFISH_TEST_REFERENCE=nbdkit runs the data-path tests against nbdkit's
    memory plugin instead of StarFish: a known-good server, to tell a broken
    test from a broken StarFish."""
    return os.environ.get("STARFISH_TEST_REFERENCE", "") == "nbdkit"


# ---------------------------------------------------------------------------
# Ports

_handed_out = set()


def _port_range():
    """This process's share of 20000..32000. Under pytest-xdist each worker draws from its
    own slice, so two workers never hand out the same port between checking it and the
    process they start binding it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = 12000 // max(count, 1)
    return 20000 + index * width, 20000 + (index + 1) * width


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on, below the kernel's
    ephemeral range (so client sockets do not take it meanwhile) and never
    handed out twice in one test run."""
    rng = random.Random()
    low, high = _port_range()
    for _ in range(1000):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOCALHOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port found in {low}..{high}")


def listening_ports():
    """Ports in LISTEN state on IPv4, read from /proc (no connection made)."""
    ports = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except FileNotFoundError:
            pass
    return ports


# ---------------------------------------------------------------------------
# Commands and processes


class CommandFailed(AssertionError):
    pass


def run(args, timeout=120, check=True, input=None, env=None, cwd=None):
    """Runs a command to completion within `timeout` seconds; returns the
    CompletedProcess (text). A timeout kills it and fails."""
    args = [str(a) for a in args]
    try:
        result = subprocess.run(
            args,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as e:
        raise CommandFailed(
            f"timed out after {timeout}s: {shlex.join(args)}\n"
            f"stdout:\n{_text(e.stdout)}\nstderr:\n{_text(e.stderr)}"
        ) from None
    if check and result.returncode != 0:
        raise CommandFailed(
            f"exit {result.returncode}: {shlex.join(args)}\n"
            f"stdout:\n{tail(result.stdout)}\nstderr:\n{tail(result.stderr)}"
        )
    return result


def _text(b):
    if b is None:
        return ""
    if isinstance(b, bytes):
        return b.decode(errors="replace")
    return b


def tail(text, lines=60):
    parts = text.splitlines()
    if len(parts) > lines:
        parts = [f"... ({len(parts) - lines} lines cut)"] + parts[-lines:]
    return "\n".join(parts)


def tail_file(path, lines=150):
    try:
        with open(path, errors="replace") as f:
            return tail(f.read(), lines)
    except OSError as e:
        return f"(cannot read {path}: {e})"


def proc_stat_fields(path):
    """The fields of a /proc `stat` file after the command name (from the state on: field 3 of
    proc(5) is index 0). The name, in parentheses, may hold spaces: the fields follow its last ')'."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def thread_states(pid):
    """The scheduler state of each thread of `pid` (/proc/PID/task/TID/stat): tid → one letter,
    'T' stopped."""
    states = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return states
    for tid in tids:
        try:
            states[int(tid)] = proc_stat_fields(f"/proc/{pid}/task/{tid}/stat")[0]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
    return states


class Process:
    """A long-running child process whose output goes to a log file."""

    def __init__(self, name, args, log_path, env=None, cwd=None):
        self.name = name
        self.args = [str(a) for a in args]
        self.log_path = log_path
        self.env = env
        self.cwd = cwd
        self.popen = None

    def start(self):
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} already running"
        log = open(self.log_path, "ab")
        log.write(f"\n==== {time.strftime('%H:%M:%S')} start: {shlex.join(self.args)}\n".encode())
        log.flush()
        try:
            self.popen = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self):
        return self.popen.pid if self.popen else None

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def returncode(self):
        return self.popen.poll() if self.popen else None

    def send_signal(self, sig):
        if self.alive():
            os.kill(self.popen.pid, sig)

    def freeze(self, timeout=10):
        """SIGSTOP, and back once every thread is stopped. The signal does not stop a process
        at once: its threads stop one by one as each next runs, and until then a thread woken
        by the network can still serve what it received (two ack-policy tests saw a stopped
        element take a write). `resume` (SIGCONT) lets it go on."""
        if not self.alive():
            return
        os.kill(self.popen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while True:
            states = thread_states(self.popen.pid)
            if all(state in "tT" for state in states.values()):
                return
            assert time.monotonic() < deadline, f"{self.name}: threads not stopped {timeout} s after SIGSTOP: {states}"
            time.sleep(0.002)

    def resume(self):
        self.send_signal(signal.SIGCONT)

    def wait(self, timeout):
        """Waits for exit; returns the exit code or None on timeout."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill9(self):
        if self.alive():
            os.kill(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=STOP_TIMEOUT)

    def stop(self, sig=signal.SIGTERM, timeout=STOP_TIMEOUT):
        """Sends `sig`, waits up to `timeout`, then SIGKILL. Returns
        (exit code, whether it had to be killed)."""
        if self.popen is None:
            return None, False
        if self.popen.poll() is not None:
            return self.popen.returncode, False
        os.kill(self.popen.pid, sig)
        code = self.wait(timeout)
        if code is not None:
            return code, False
        self.kill9()
        return self.popen.returncode, True

    def reap_group(self):
        """Kills what is left of this child's own process group (processes it
        forked), by the group id that is this child's PID."""
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log(self, lines=150):
        return tail_file(self.log_path, lines)


def assert_dropped(sock, what):
    """Asserts that the far end closed `sock` (within the socket's timeout), then closes it."""
    try:
        assert sock.recv(65536) == b"", what
    except ConnectionResetError:
        pass
    sock.close()


def wait_until(predicate, timeout, what, interval=0.2):
    """Polls `predicate` until it returns a true value (returned) or `timeout`
    passes (AssertionError naming `what` and the last value or error)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as e:  # noqa: BLE001 - reported below
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last}")
        time.sleep(interval)


def wait_listening(process, port, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise AssertionError(
                f"{process.name} exited with {process.returncode()} before listening on {port}\n"
                f"--- {process.name} log:\n{process.log()}"
            )
        if port in listening_ports():
            return
        time.sleep(0.05)
    raise AssertionError(
        f"{process.name} is not listening on {port} after {timeout}s\n--- {process.name} log:\n{process.log()}"
    )


# ---------------------------------------------------------------------------
# The StarFish cluster


# The element whose data lives in memory (tmpfs): its commits run on its actor, the others'
# on their committer threads, so every cluster test runs both ways side by side.
MEMORY_ELEMENT = "near"
MEMORY_DIR = "/dev/shm"


class Element:
    def __init__(self, name, workdir, extra=(), memory=False, data_root=None):
        self.name = name
        self.port = free_port()
        if data_root:
            self.memory_dir = None
            self.data = os.path.join(data_root, f"element-{name}")
        elif memory and os.path.isdir(MEMORY_DIR):
            self.memory_dir = tempfile.mkdtemp(prefix=f"starfish-test-element-{name}-", dir=MEMORY_DIR)
            self.data = os.path.join(self.memory_dir, "data")
        else:
            self.memory_dir = None
            self.data = os.path.join(workdir, f"element-{name}")
        os.makedirs(self.data, exist_ok=True)
        self.process = Process(
            f"element-{name}",
            [starfish_bin(), "element", "--listen", self.address, "--data", self.data, *extra],
            os.path.join(workdir, f"element-{name}.log"),
        )

    @property
    def address(self):
        return f"{LOCALHOST}:{self.port}"

    def start(self):
        self.process.start()
        wait_listening(self.process, self.port)

    def log_bytes(self):
        """Bytes the element's log files take on their file system."""
        log_dir = os.path.join(self.data, "log")
        return sum(os.stat(os.path.join(log_dir, n)).st_blocks * 512 for n in os.listdir(log_dir))

    def live_segment(self):
        """The number of the element's newest log segment: it grows by one per seal."""
        names = os.listdir(os.path.join(self.data, "log"))
        return max(int(n.split(".")[0]) for n in names if n.endswith(".seg"))

    def verify(self):
        """`starfish element verify --json` of this (stopped) element."""
        assert not self.process.alive(), f"element {self.name} must be stopped before verify"
        result = run([starfish_bin(), "element", "verify", "--data", self.data, "--json"], timeout=300)
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError as e:
            raise AssertionError(f"element verify printed no JSON ({e}):\n{result.stdout}") from None


class Cluster:
    """Three elements (local, near, far) and a host exporting volumes over
    NBD. Logs go to files in `workdir`; `logs()` gathers their tails."""

    def __init__(self, workdir, volumes=(("vol0", "1GiB"),), quorum=2, host_extra=(), use_config=False, tls=False,
                 ack=None, far_links=None, addresses=None, element_extra=(), data_root=None):
        self.workdir = workdir
        # Ack policy per element name ("received", "network-sync", …); the rest are durable.
        self.ack = dict(ack or {})
        # Far link per element name, (fec, rate) such as ("8:3", "100Mbit") or ("8:3", None):
        # reached over UDP with FEC; the rest over TCP.
        self.far_links = dict(far_links or {})
        # The address the host element dials per element name, when not the element's own
        # (say, the far end of an emulated link).
        self.addresses = dict(addresses or {})
        self.volumes = list(volumes)
        self.quorum = quorum
        self.host_extra = list(host_extra)
        self.use_config = use_config
        # With `tls`: `starfish certs init` makes the cluster's certificates in `certs`: the
        # host element "host", the elements, an operator "admin" and an NBD host "nbdclient".
        self.certs = os.path.join(workdir, "certs") if tls else None
        if tls:
            run([starfish_bin(), "certs", "init", self.certs, "--host", "host", "--element", *ELEMENT_NAMES,
                 "--client", "admin", "--nbd-client", "nbdclient"], timeout=60)
            self.host_extra += ["--tls-dir", os.path.join(self.certs, "host")]
        # `element_extra`: more arguments for every element (`--placed-writes`, say).
        # `data_root`: every element's data directory goes there (none in memory); a dict gives
        # the directory per element name (the others as without it).
        roots = data_root if isinstance(data_root, dict) else {name: data_root for name in ELEMENT_NAMES}
        self.elements = {
            name: Element(name, workdir,
                          (["--tls-dir", os.path.join(self.certs, name)] if tls else []) + list(element_extra),
                          memory=name == MEMORY_ELEMENT, data_root=roots.get(name))
            for name in ELEMENT_NAMES
        }
        self.nbd_port = free_port()
        self.admin_port = free_port()
        self.host = Process("host", self.host_args(), os.path.join(workdir, "host.log"))

    # -- configuration

    @property
    def admin(self):
        return f"{LOCALHOST}:{self.admin_port}"

    @property
    def nbd_address(self):
        return f"{LOCALHOST}:{self.nbd_port}"

    def config_toml(self):
        lines = [
            f'nbd = "{self.nbd_address}"',
            f'admin = "{self.admin}"',
            f"quorum = {self.quorum}",
            "",
        ]
        if self.certs:
            lines.insert(3, f'tls_dir = "{os.path.join(self.certs, "host")}"')
        for element in self.elements.values():
            address = self.addresses.get(element.name, element.address)
            lines += ["[[element]]", f'name = "{element.name}"', f'address = "{address}"']
            if element.name in self.ack:
                lines.append(f'ack = "{self.ack[element.name]}"')
            if element.name in self.far_links:
                fec, rate = self.far_links[element.name]
                lines.append(f'fec = "{fec}"')
                if rate:
                    lines.append(f'rate = "{rate}"')
            lines.append("")
        for name, size in self.volumes:
            lines += ["[[volume]]", f'name = "{name}"', f'size = "{size}"', ""]
        return "\n".join(lines)

    def host_args(self):
        if self.use_config:
            path = os.path.join(self.workdir, "host.toml")
            with open(path, "w") as f:
                f.write(self.config_toml())
            return [starfish_bin(), "host", "--config", path] + self.host_extra
        args = [starfish_bin(), "host", "--nbd", self.nbd_address, "--admin", self.admin]
        for element in self.elements.values():
            options = f",ack={self.ack[element.name]}" if element.name in self.ack else ""
            if element.name in self.far_links:
                fec, rate = self.far_links[element.name]
                options += f",fec={fec}" + (f",rate={rate}" if rate else "")
            address = self.addresses.get(element.name, element.address)
            args += ["--element", f"{element.name}={address}{options}"]
        args += ["--quorum", str(self.quorum)]
        for name, size in self.volumes:
            args += ["--volume", f"{name}:{size}"]
        return args + self.host_extra

    def uri(self, volume="vol0", certificates="admin"):
        """The volume's NBD URI; with TLS, `nbds://` with the named client's certificates."""
        if self.certs:
            return f"nbds://{LOCALHOST}:{self.nbd_port}/{volume}?tls-certificates={os.path.join(self.certs, certificates)}"
        return f"nbd://{LOCALHOST}:{self.nbd_port}/{volume}"

    # -- lifecycle

    def start(self):
        for element in self.elements.values():
            element.start()
        self.start_host()
        return self

    def start_host(self, ready=True):
        self.host.start()
        wait_listening(self.host, self.admin_port)
        wait_listening(self.host, self.nbd_port)
        if ready:
            self.wait_healthy()

    def stop_host(self, sig=signal.SIGTERM):
        code, killed = self.host.stop(sig)
        return code, killed

    def kill_element(self, name, sig=signal.SIGKILL):
        element = self.elements[name]
        element.process.send_signal(sig)
        code = element.process.wait(STOP_TIMEOUT)
        assert code is not None, f"element {name} did not exit on signal {sig}"
        return code

    def restart_element(self, name):
        element = self.elements[name]
        assert not element.process.alive(), f"element {name} is still running"
        element.start()

    def stop(self):
        """Stops the host, then the elements, with SIGTERM. Returns a list of
        complaints (a process that needed SIGKILL or exited non-zero)."""
        complaints = []
        processes = [self.host] + [e.process for e in self.elements.values()]
        for process in processes:
            was_alive = process.alive()
            code, killed = process.stop(signal.SIGTERM)
            if was_alive and killed:
                complaints.append(f"{process.name} ignored SIGTERM for {STOP_TIMEOUT}s and was killed")
            elif was_alive and code not in (0, None):
                complaints.append(f"{process.name} exited with {code} on SIGTERM")
        return complaints

    def destroy(self):
        """Kills everything still running (teardown) and removes the data kept in memory;
        never raises."""
        for process in [self.host] + [e.process for e in self.elements.values()]:
            try:
                process.kill9()
            except Exception:  # noqa: BLE001 - teardown must go on
                pass
            process.reap_group()
        for element in self.elements.values():
            if element.memory_dir:
                remove_workdir(element.memory_dir)

    # -- observation

    def status(self, timeout=STATUS_TIMEOUT):
        result = run([starfish_bin(), "status", "--admin", self.admin, "--json"], timeout=timeout)
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError as e:
            raise AssertionError(f"status printed no JSON ({e}):\n{result.stdout}") from None

    def wait_status(self, predicate, timeout, what):
        """Polls status until `predicate(status)` holds; returns that status."""
        seen = {}

        def check():
            if not self.host.alive():
                raise HostDied(f"host exited with {self.host.returncode()}\n--- host log:\n{self.host.log()}")
            status = self.status()
            seen["last"] = status
            return status if predicate(status) else None

        try:
            return wait_until(check, timeout, what, interval=0.25)
        except HostDied as e:
            raise AssertionError(str(e)) from None
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast status: {json.dumps(seen.get('last'), indent=1)}") from None

    def wait_healthy(self, timeout=START_TIMEOUT):
        return self.wait_status(healthy, timeout, "all elements in-sync and every volume read-write")

    def wait_caught_up(self, names=ELEMENT_NAMES, timeout=60):
        """Waits until the named elements are in sync and have applied (made durable) every
        write the host element acknowledged, on every volume; returns that status."""

        def caught_up(status):
            by_name = {e["name"]: e for e in status["elements"]}
            return all(
                volume["mode"] == "read-write"
                and all(
                    by_name[name]["state"] == "in-sync"
                    and by_name[name]["applied_sequence"].get(volume["name"]) == volume["acked_sequence"]
                    for name in names
                )
                for volume in status["volumes"]
            )

        return self.wait_status(caught_up, timeout, f"{', '.join(names)} to apply every acknowledged write")

    def element_state(self, status, name):
        for element in status["elements"]:
            if element["name"] == name:
                return element["state"]
        raise AssertionError(f"element {name} missing from status: {status}")

    def logs(self, lines=150):
        parts = []
        for process in [self.host] + [e.process for e in self.elements.values()]:
            parts.append((process.name, tail_file(process.log_path, lines)))
        return parts

    def log_files(self):
        """(name, path) of every process's whole log, kept when a test fails."""
        return [(p.name, p.log_path) for p in [self.host] + [e.process for e in self.elements.values()]]


class HostDied(Exception):
    pass


def volume_status(status, name="vol0"):
    for volume in status["volumes"]:
        if volume["name"] == name:
            return volume
    raise AssertionError(f"volume {name} missing from status: {status}")


def element_of(status, name):
    for element in status["elements"]:
        if element["name"] == name:
            return element
    raise AssertionError(f"element {name} missing from status: {status}")


def healthy(status):
    return all(e["state"] == "in-sync" for e in status["elements"]) and all(
        v["mode"] == "read-write" for v in status["volumes"]
    )


# ---------------------------------------------------------------------------
# Reference server (nbdkit), for STARFISH_TEST_REFERENCE=nbdkit


class ReferenceServer:
    """nbdkit's memory plugin with the block size constraints StarFish
    advertises (512 / 4096 / 32 MiB) and errors on unaligned requests, one
    export named like the volume."""

    def __init__(self, workdir, volume="vol0", size="1G"):
        self.workdir = workdir
        self.volume = volume
        self.nbd_port = free_port()
        self.process = Process(
            "nbdkit",
            [
                "nbdkit", "--foreground", "--exit-with-parent", "-i", LOCALHOST, "-p", self.nbd_port,
                "--filter=exportname", "--filter=blocksize-policy",
                "memory", size,
                f"exportname={volume}", "exportname-strict=true", "exportname-list=explicit",
                "blocksize-minimum=512", "blocksize-preferred=4096",
                "blocksize-maximum=33554432", "blocksize-error-policy=error",
            ],
            os.path.join(workdir, "nbdkit.log"),
        )

    def start(self):
        self.process.start()
        wait_listening(self.process, self.nbd_port)
        return self

    def uri(self, volume="vol0"):
        return f"nbd://{LOCALHOST}:{self.nbd_port}/{volume}"

    @property
    def host(self):
        return self.process

    def destroy(self):
        self.process.kill9()

    def logs(self, lines=150):
        return [("nbdkit", tail_file(self.process.log_path, lines))]


# ---------------------------------------------------------------------------
# NBD client with bounded operations


class Timeout(AssertionError):
    pass


class Client:
    """A libnbd handle whose every operation runs asynchronously and is
    abandoned (as a test failure) after `timeout` seconds, so a server that
    hangs fails the test instead of hanging it."""

    def __init__(self, uri, timeout=NBD_OP_TIMEOUT, strict=True, meta_contexts=()):
        self.uri = uri
        self.timeout = timeout
        self.h = nbd.NBD()
        self.h.set_handle_name("test-client")
        # nbds:// URIs name the client's certificate directory (tls-certificates=DIR).
        self.h.set_uri_allow_local_file(True)
        for context in meta_contexts:
            self.h.add_meta_context(context)
        if not strict:
            self.h.set_strict_mode(0)
        self.h.aio_connect_uri(uri)
        self._poll_until(lambda: not self.h.aio_is_connecting(), f"connect to {uri}")
        if not self.h.aio_is_ready():
            raise AssertionError(f"NBD connection to {uri} not ready (state {self.h.connection_state()})")

    def _poll_until(self, done, what):
        deadline = time.monotonic() + self.timeout
        while not done():
            if time.monotonic() > deadline:
                raise Timeout(f"NBD {what} did not complete within {self.timeout}s ({self.uri})")
            if self.h.aio_is_dead() or self.h.aio_is_closed():
                raise nbd.Error(f"connection dead during {what}: {self.h.connection_state()}", errno.ECONNRESET)
            self.h.poll(100)

    def _wait(self, cookie, what):
        self._poll_until(lambda: self.h.aio_command_completed(cookie), what)

    def pread(self, length, offset, flags=0):
        buf = nbd.Buffer(length)
        cookie = self.h.aio_pread(buf, offset, flags=flags)
        self._wait(cookie, f"read {length}@{offset}")
        return buf.to_bytearray()

    def pwrite(self, data, offset, flags=0):
        buf = nbd.Buffer.from_bytearray(bytearray(data))
        cookie = self.h.aio_pwrite(buf, offset, flags=flags)
        self._wait(cookie, f"write {len(data)}@{offset}")

    def trim(self, length, offset, flags=0):
        self._wait(self.h.aio_trim(length, offset, flags=flags), f"trim {length}@{offset}")

    def zero(self, length, offset, flags=0):
        self._wait(self.h.aio_zero(length, offset, flags=flags), f"zero {length}@{offset}")

    def flush(self):
        self._wait(self.h.aio_flush(), "flush")

    def block_status(self, length, offset):
        """Returns [(length, flags)] extents of base:allocation."""
        extents = []

        def callback(metacontext, offset_, entries, err):
            if metacontext == nbd.CONTEXT_BASE_ALLOCATION:
                for i in range(0, len(entries), 2):
                    extents.append((entries[i], entries[i + 1]))
            return 0

        self._wait(self.h.aio_block_status(length, offset, callback), f"block status {length}@{offset}")
        return extents

    def size(self):
        return self.h.get_size()

    def close(self):
        try:
            if self.h.aio_is_ready():
                self.h.aio_disconnect()
                deadline = time.monotonic() + 5
                while not self.h.aio_is_closed() and not self.h.aio_is_dead() and time.monotonic() < deadline:
                    self.h.poll(100)
        except nbd.Error:
            pass
        # Dropping the last reference closes the handle and its socket.
        self.h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.h is not None:
            self.close()


def expect_nbd_error(fn, errnos, what):
    """Runs `fn`, which must fail with an NBD error whose errno is in `errnos`;
    returns the nbd.Error."""
    try:
        fn()
    except nbd.Error as e:
        assert e.errnum in errnos, (
            f"{what}: expected errno {[errno.errorcode.get(n, n) for n in errnos]}, "
            f"got {errno.errorcode.get(e.errnum, e.errnum)} ({e.string})"
        )
        return e
    raise AssertionError(f"{what}: succeeded, expected an NBD error {[errno.errorcode.get(n, n) for n in errnos]}")


# ---------------------------------------------------------------------------
# Data patterns

BLOCK = 4096
STAMP_MAGIC = b"SFTESTBK"
_STAMP = struct.Struct("<8sQQ")  # magic, offset, generation


def stamp_block(offset, generation, size=BLOCK):
    """A block that says where it belongs and which write put it there, with
    a body derived from both, so torn or misplaced blocks are recognised."""
    header = _STAMP.pack(STAMP_MAGIC, offset, generation)
    seed = hashlib.sha256(header).digest()
    body = (seed * (size // len(seed) + 1))[: size - len(header)]
    return header + body


def parse_block(data, size=BLOCK):
    """Returns (offset, generation) of a stamped block, 'zero' for an
    all-zero block, or None if the block is neither (torn or foreign)."""
    if data == bytes(size):
        return "zero"
    magic, offset, generation = _STAMP.unpack_from(data)
    if magic != STAMP_MAGIC or stamp_block(offset, generation, size) != bytes(data):
        return None
    return offset, generation


def random_bytes(n, seed):
    return random.Random(seed).randbytes(n)


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# Raw NBD protocol, for malformed input

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
OPT_REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
STRUCTURED_REPLY_MAGIC = 0x668E33EF
NBD_OPT_EXPORT_NAME = 1
NBD_OPT_ABORT = 2
NBD_OPT_LIST = 3
NBD_OPT_GO = 7
NBD_REP_ACK = 1
NBD_REP_SERVER = 2
NBD_REP_INFO = 3
NBD_REP_ERR_UNSUP = 0x80000001
NBD_FLAG_FIXED_NEWSTYLE = 1
NBD_FLAG_NO_ZEROES = 2
NBD_CMD_READ = 0


class RawNbd:
    """A hand-driven NBD connection (fixed newstyle, simple replies)."""

    def __init__(self, port, timeout=10.0):
        self.sock = socket.create_connection((LOCALHOST, port), timeout=timeout)
        self.sock.settimeout(timeout)

    def recv_exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"server closed the connection after {len(data)} of {n} bytes")
            data += chunk
        return data

    def greeting(self):
        magic, opt, flags = struct.unpack(">QQH", self.recv_exact(18))
        assert magic == NBDMAGIC and opt == IHAVEOPT, f"bad greeting {magic:#x} {opt:#x}"
        assert flags & NBD_FLAG_FIXED_NEWSTYLE, f"server is not fixed newstyle (flags {flags:#x})"
        return flags

    def client_flags(self, flags=NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES):
        self.sock.sendall(struct.pack(">I", flags))

    def send_option(self, option, data=b""):
        self.sock.sendall(struct.pack(">QII", IHAVEOPT, option, len(data)) + data)

    def option_reply(self):
        magic, option, reply, length = struct.unpack(">QIII", self.recv_exact(20))
        assert magic == OPT_REPLY_MAGIC, f"bad option reply magic {magic:#x}"
        return option, reply, self.recv_exact(length)

    def go(self, name):
        """NBD_OPT_GO; returns (size, transmission flags)."""
        encoded = name.encode()
        self.send_option(NBD_OPT_GO, struct.pack(">I", len(encoded)) + encoded + struct.pack(">H", 0))
        size = flags = None
        while True:
            option, reply, data = self.option_reply()
            assert option == NBD_OPT_GO, f"reply to option {option}"
            if reply == NBD_REP_ACK:
                break
            assert reply == NBD_REP_INFO, f"NBD_OPT_GO {name!r} failed with reply {reply:#x}: {data!r}"
            (info,) = struct.unpack_from(">H", data)
            if info == 0:  # NBD_INFO_EXPORT
                _, size, flags = struct.unpack(">HQH", data)
        assert size is not None, "NBD_OPT_GO: no NBD_INFO_EXPORT"
        return size, flags

    def handshake(self, name):
        self.greeting()
        self.client_flags()
        return self.go(name)

    def request(self, cmd, offset, length, handle, flags=0, payload=b""):
        self.sock.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, flags, cmd, handle, offset, length) + payload)

    def simple_reply(self):
        magic, error, handle = struct.unpack(">IIQ", self.recv_exact(16))
        assert magic == SIMPLE_REPLY_MAGIC, f"expected a simple reply, got magic {magic:#x}"
        return error, handle

    def closed_by_server(self, timeout):
        """True if the server closes the connection within `timeout` seconds
        (whatever it sends before); False if it stays open and silent."""
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        return False

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


def make_workdir(prefix="starfish-test-"):
    return tempfile.mkdtemp(prefix=prefix)


def remove_workdir(path):
    if os.environ.get("STARFISH_TEST_KEEP"):
        return
    shutil.rmtree(path, ignore_errors=True)


def during_counter_writes(cluster, first, second, action):
    """Runs `action()` while a writer writes an increasing counter (8 bytes, repeated over
    4 KiB) to block 0 of export `first` and then, once that is acknowledged, to block 0 of
    `second`: a point of one order holds `second`'s counter ≤ `first`'s ≤ `second`'s + 1. At
    least 20 writes come before the action and 20 after it. Returns what the action returned
    and the last counter written."""
    stop, written = threading.Event(), []

    def writer():
        with Client(cluster.uri(first)) as one, Client(cluster.uri(second)) as other:
            k = 0
            while not stop.is_set() and k < 100000:
                k += 1
                block = k.to_bytes(8, "little") * 512
                one.pwrite(block, 0)
                other.pwrite(block, 0)
                written.append(k)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_until(lambda: len(written) >= 20, 30, "the writer to get going")
        result = action()
        after = len(written)
        wait_until(lambda: len(written) >= after + 20, 30, "more writes after the action")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the counter writer did not stop"
    return result, written[-1]


# ---------------------------------------------------------------------------
# Write load (nbd_writer.py) and its checker


class WriteLog:
    """What nbd_writer.py logged: per block, the generations submitted and the
    newest acknowledged one; the writes that failed."""

    def __init__(self, path, offset, blocks):
        self.offset = offset
        self.blocks = blocks
        self.submitted = {}  # block index -> set of generations
        self.acked = {}  # block index -> newest acknowledged generation
        self.failed = []  # (generation, errno, message)
        self.max_generation = 0
        self.spans = {}  # generation -> range of block indexes
        self.acked_count = 0
        self.done = False
        spans = {}
        with open(path) as f:
            for line in f:
                parts = line.split(maxsplit=3)
                if not parts:
                    continue
                if parts[0] == "S":
                    gen, off, n = int(parts[1]), int(parts[2]), int(parts[3])
                    first = (off - offset) // BLOCK
                    spans[gen] = range(first, first + n)
                    self.max_generation = max(self.max_generation, gen)
                    for b in spans[gen]:
                        self.submitted.setdefault(b, set()).add(gen)
                elif parts[0] == "A":
                    gen = int(parts[1])
                    self.acked_count += 1
                    for b in spans[gen]:
                        self.acked[b] = max(self.acked.get(b, 0), gen)
                elif parts[0] == "E":
                    self.failed.append(line.strip())
                elif line.startswith("# done"):
                    self.done = True
        self.spans = spans


def count_acks(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.startswith("A "))
    except FileNotFoundError:
        return 0


def check_stamped_region(client, write_log, chunk=1 * MiB):
    """Reads the whole region back; returns a list of problems: a block that
    is torn or misplaced, older than its newest acknowledged write, or holds
    a generation never written there."""
    problems = []
    base, blocks = write_log.offset, write_log.blocks
    found_generation = {}  # block index -> generation found (0 for zero)
    per_chunk = chunk // BLOCK
    for first in range(0, blocks, per_chunk):
        n = min(per_chunk, blocks - first)
        data = client.pread(n * BLOCK, base + first * BLOCK)
        for i in range(n):
            b = first + i
            offset = base + b * BLOCK
            found = parse_block(bytes(data[i * BLOCK:(i + 1) * BLOCK]))
            acked = write_log.acked.get(b)
            submitted = write_log.submitted.get(b, set())
            if found is None:
                problems.append(f"block @{offset}: neither zero nor a whole stamped block (torn or corrupt)")
            elif found == "zero":
                found_generation[b] = 0
                if acked is not None:
                    problems.append(f"block @{offset}: zero, but generation {acked} was acknowledged")
            else:
                off, gen = found
                found_generation[b] = gen
                if off != offset:
                    problems.append(f"block @{offset}: holds the block of offset {off} (gen {gen})")
                elif gen not in submitted:
                    problems.append(f"block @{offset}: generation {gen} was never written there")
                elif acked is not None and gen < acked:
                    problems.append(f"block @{offset}: generation {gen} older than acknowledged {acked}")
        if len(problems) > 50:
            problems.append("... (stopped after 50 problems)")
            return problems
    # Each request is atomic: a multi-block write whose data shows in one of
    # its blocks shows in all of them (or was overwritten there by a later one).
    for gen, span in write_log.spans.items():
        if len(span) < 2:
            continue
        seen = [b for b in span if found_generation.get(b) == gen]
        older = [b for b in span if found_generation.get(b, gen) < gen]
        if seen and older:
            problems.append(
                f"write {gen} of blocks {span.start}..{span.stop - 1} is torn: "
                f"found in {seen}, older data in {older} ({[found_generation.get(b) for b in span]})"
            )
            if len(problems) > 50:
                break
    return problems


def start_writer(workdir, uri, offset, blocks, seed, name="writer", **options):
    """Starts nbd_writer.py; returns (process, log path, stop-file path)."""
    log_path = os.path.join(workdir, f"{name}.log")
    stop_file = os.path.join(workdir, f"{name}.stop")
    args = [
        "/usr/bin/python3", os.path.join(REPO, "tests", "nbd_writer.py"), uri, log_path,
        "--offset", offset, "--blocks", blocks, "--seed", seed, "--stop-file", stop_file,
    ]
    for key, value in options.items():
        args += ["--" + key.replace("_", "-"), value]
    process = Process(name, args, os.path.join(workdir, f"{name}.out"))
    process.start()
    return process, log_path, stop_file


class LoadWriter:
    """nbd_writer.py as a context manager: started on entry, stopped (and
    killed if need be) on exit."""

    def __init__(self, workdir, uri, blocks, seed, name="writer", offset=0, **options):
        self.args = (workdir, uri, offset, blocks, seed)
        self.name = name
        self.options = options
        self.process = self.log_path = self.stop_file = None

    def __enter__(self):
        workdir, uri, offset, blocks, seed = self.args
        self.process, self.log_path, self.stop_file = start_writer(
            workdir, uri, offset, blocks, seed, name=self.name, **self.options
        )
        return self

    def acks(self):
        return count_acks(self.log_path)

    def wait_acks(self, more, timeout=120, what="acknowledged writes"):
        """Waits until `more` writes beyond the current count are acknowledged."""
        target = self.acks() + more
        wait_until(lambda: self.acks() >= target or not self.process.alive(), timeout, f"{more} more {what}")
        assert self.process.alive(), (
            f"writer exited with {self.process.returncode()} while waiting for {what}:\n"
            f"{self.process.log()}\n{tail_file(self.log_path, 20)}"
        )

    def finish(self, timeout=90):
        """Asks the writer to stop; returns its exit code."""
        open(self.stop_file, "w").close()
        return self.process.wait(timeout)

    def output(self):
        return f"{self.process.log()}\n--- last lines of {self.log_path}:\n{tail_file(self.log_path, 20)}"

    def __exit__(self, *exc):
        open(self.stop_file, "w").close()
        self.process.stop(signal.SIGTERM, timeout=10)


# ---------------------------------------------------------------------------
# An emulated WAN link in network namespaces, and a far element behind it


class NetnsLink:
    """`starfish link --netns --root-end`: end A is this (root) namespace, end B a namespace
    of its own where the far element runs; `set`, `cut`, `heal` go to its stdin."""

    def __init__(self, workdir, delay_ms, loss_pct, rate_mbit, duration_s=600):
        self.log_path = os.path.join(workdir, "link.log")
        self.args = [starfish_bin(), "link", "--netns", "--root-end", "--delay-ms", str(delay_ms),
                     "--loss", str(loss_pct), "--rate-mbit", str(rate_mbit), "--duration", str(duration_s)]
        self.popen = None
        self.namespace = None
        self.address = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

        def up():
            match = re.search(r"end B: (\S+) in namespace (\S+)", tail_file(self.log_path))
            if self.popen.poll() is not None:
                raise AssertionError(f"starfish link exited:\n{tail_file(self.log_path)}")
            return match

        match = wait_until(up, 30, "the emulated link up")
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
        return [("link", tail_file(self.log_path, lines))]


class LinkProxy:
    """`starfish link` as a TCP proxy to an element (`delay_ms` one way, `rate_mbit` or
    unlimited); `cut`, `heal` and `set` go to its stdin."""

    def __init__(self, workdir, name, target_port, delay_ms, rate_mbit=None):
        self.name = name
        self.port = free_port()
        self.log_path = os.path.join(workdir, f"link-{name}.log")
        self.args = [
            starfish_bin(), "link", "--listen", f"{LOCALHOST}:{self.port}",
            "--target", f"{LOCALHOST}:{target_port}", "--delay-ms", str(delay_ms),
        ] + (["--rate-mbit", str(rate_mbit)] if rate_mbit else [])
        self.popen = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        wait_until(lambda: self.port in listening_ports() or self.popen.poll() is not None,
                           START_TIMEOUT, f"link proxy {self.name} listening")
        assert self.popen.poll() is None, f"link proxy {self.name} exited:\n{tail_file(self.log_path)}"

    def command(self, line):
        assert self.popen.poll() is None, f"link proxy {self.name} exited:\n{tail_file(self.log_path)}"
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()

    def panicked(self):
        with open(self.log_path, errors="replace") as f:
            return "panicked" in f.read()

    def restart(self):
        self.destroy()
        self.popen = None
        self.start()

    def destroy(self):
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=STOP_TIMEOUT)
        try:
            self.popen.stdin.close()
        except OSError:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class LinkedCluster(Cluster):
    """A Cluster whose host reaches some elements through link proxies: `links` maps an
    element's name to the (one-way delay ms, rate Mbit/s or None) of its link."""

    def __init__(self, workdir, links, **kwargs):
        self.proxies = {}
        super().__init__(workdir, **kwargs)
        for name, (delay_ms, rate_mbit) in links.items():
            self.proxies[name] = LinkProxy(workdir, name, self.elements[name].port, delay_ms, rate_mbit)
        self.host.args = [str(a) for a in self.host_args()]

    def host_args(self):
        args = super().host_args()
        for name, proxy in self.proxies.items():
            element = self.elements[name]
            i = args.index(f"{name}={element.address}")
            args[i] = f"{name}={LOCALHOST}:{proxy.port}"
        return args

    def start(self):
        for proxy in self.proxies.values():
            proxy.start()
        return super().start()

    def destroy(self):
        super().destroy()
        for proxy in self.proxies.values():
            proxy.destroy()

    def logs(self, lines=150):
        return super().logs(lines) + [(f"link-{n}", tail_file(p.log_path, 40)) for n, p in self.proxies.items()]

    def log_files(self):
        return super().log_files() + [(f"link-{n}", p.log_path) for n, p in self.proxies.items()]

    def fast_status(self):
        """GET /status from the admin port (quicker than `starfish status`)."""
        with urllib.request.urlopen(f"http://{self.admin}/status", timeout=5) as r:
            return json.loads(r.read())


def place_far_element_behind(cluster, link):
    """Run the cluster's far element inside the link's namespace, on end B's address."""
    far = cluster.elements["far"]
    address = f"{link.address}:{far.port}"
    far.process.args = ["ip", "netns", "exec", link.namespace] + far.process.args
    far.process.args[far.process.args.index("--listen") + 1] = address
    # Not loopback: the element wants TLS or --insecure (the namespace is ours alone).
    far.process.args.append("--insecure")
    cluster.addresses["far"] = address
    cluster.host = Process("host", cluster.host_args(), cluster.host.log_path)
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

    wait_until(reachable, 30, "the far element listening behind the link")
    cluster.start_host()


class Relay:
    """A TCP relay on 127.0.0.1 to `target` (host, port): one element behind a second address.
    `answers(source, sink)` carries the target's side back to the client (default: the bytes as
    they come); it ends by shutting both down (`Relay.shut`). Threads are daemons; `close()`
    ends every connection."""

    def __init__(self, target, answers=None):
        self.target = target
        self.answers = answers or self.pump
        self.listener = socket.create_server((LOCALHOST, 0))
        self.port = self.listener.getsockname()[1]
        self.sockets = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self):
        return f"{LOCALHOST}:{self.port}"

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.sockets += [client, upstream]
            threading.Thread(target=self.pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self.answers, args=(upstream, client), daemon=True).start()

    @staticmethod
    def shut(*sockets):
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @classmethod
    def pump(cls, source, sink):
        try:
            while chunk := source.recv(256 * KiB):
                sink.sendall(chunk)
        except OSError:
            pass
        cls.shut(source, sink)

    def close(self):
        self.closed = True
        with self.lock:
            sockets = [self.listener] + self.sockets
        for s in sockets:
            self.shut(s)  # wakes the threads blocked on it
            s.close()


class TamperingProxy:
    """A `Relay` in front of one element that can damage one read reply on its way back, as a
    faulty NIC, switch or memory on the path would: `Shared.arm(where)` flips one bit of the
    next successful read reply of at least `READ_BYTES_MIN` bytes, in its data
    (`where="data"`: the frame's checksum, made from the blocks' checksums, still matches) or in
    its block checksums (`where="checksums"`: the frame's checksum no longer does). Proxies
    built with one `TamperingProxy.Shared` damage one reply between them.

    It reads the element's side as frames (8-byte header: body length, crc32c; then the
    body). With `tls`, it reads it as TLS records instead (5-byte header: content type,
    version, length; then the sealed record), and `Shared.arm("tls")` flips one bit in the
    middle of the next record of application data of at least `TLS_RECORD_BYTES_MIN` bytes:
    such records carry large read replies, since the element's other messages are small."""

    READ_BYTES_MIN = 64 * KiB
    _ELEMENT_READ_REPLY = 4
    _RESULT_OK = 0
    _DATA_AT = 1 + 8 + 8 + 1 + 4  # tag, request id, applied sequence, result, data length
    _FRAME_BODY_MAX = 64 * MiB  # beyond any frame: the stream is not ours, relay it as it is

    class Shared:
        def __init__(self):
            self.lock = threading.Lock()
            self.where = None
            self.damaged = []  # (proxy name, where, data length) of each damaged reply

        def arm(self, where):
            assert where in ("data", "checksums", "tls"), where
            with self.lock:
                self.where = where

        def take(self):
            with self.lock:
                where, self.where = self.where, None
                return where

    TLS_RECORD_BYTES_MIN = 8 * KiB
    _TLS_APPLICATION_DATA = 23

    def __init__(self, name, target_port, shared, tls=False):
        self.name = name
        self.shared = shared
        self.relay = Relay((LOCALHOST, target_port), answers=self._records if tls else self._frames)

    @property
    def address(self):
        return self.relay.address

    @staticmethod
    def _read_exactly(source, n):
        parts, left = [], n
        while left:
            chunk = source.recv(min(left, 1 * MiB))
            if not chunk:
                return None
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def _frames(self, source, sink):
        try:
            while (header := self._read_exactly(source, 8)) is not None:
                length = struct.unpack_from("<I", header)[0]
                if length > self._FRAME_BODY_MAX:
                    sink.sendall(header)
                    return Relay.pump(source, sink)
                body = self._read_exactly(source, length)
                if body is None:
                    break
                sink.sendall(header + self._maybe_damage(bytearray(body)))
        except OSError:
            pass
        Relay.shut(source, sink)

    def _records(self, source, sink):
        try:
            while (header := self._read_exactly(source, 5)) is not None:
                kind, length = header[0], struct.unpack_from(">H", header, 3)[0]
                record = self._read_exactly(source, length)
                if record is None:
                    break
                if kind == self._TLS_APPLICATION_DATA and length >= self.TLS_RECORD_BYTES_MIN:
                    where = self.shared.take()
                    if where == "tls":
                        record = bytearray(record)
                        record[length // 2] ^= 0x10
                        with self.shared.lock:
                            self.shared.damaged.append((self.name, where, length))
                sink.sendall(header + bytes(record))
        except OSError:
            pass
        Relay.shut(source, sink)

    def _maybe_damage(self, body):
        at = self._DATA_AT
        if len(body) < at or body[0] != self._ELEMENT_READ_REPLY or body[at - 5] != self._RESULT_OK:
            return bytes(body)
        data_bytes = struct.unpack_from("<I", body, at - 4)[0]
        if data_bytes < self.READ_BYTES_MIN or len(body) < at + data_bytes + 8:
            return bytes(body)
        where = self.shared.take()
        if where == "data":
            body[at + data_bytes // 2] ^= 0x10
        elif where == "checksums":
            body[at + data_bytes + 4] ^= 0x10  # the first block's checksum
        if where:
            with self.shared.lock:
                self.shared.damaged.append((self.name, where, data_bytes))
        return bytes(body)

    def destroy(self):
        self.relay.close()


# ---------------------------------------------------------------------------
# File systems on NBD exports: ext4 through nbdfuse and a loop device; a disk that loses
# what it was not told to flush when its power goes


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def abort_fuse(mountpoint, minor=None):
    """Last resort for a FUSE mount whose server hangs: abort the connection
    through fusectl, so nothing stays stuck in the kernel. `minor`: the mount's device
    minor, if known (a `stat` of a hung mount may hang too)."""
    try:
        if minor is None:
            minor = os.minor(os.stat(mountpoint).st_dev)
        path = f"/sys/fs/fuse/connections/{minor}/abort"
        if os.path.exists(path):
            with open(path, "w") as f:
                f.write("1")
    except OSError:
        pass


def unmount(mountpoint, problems):
    """Unmounts `mountpoint` if mounted; lazily if that fails (said in `problems`)."""
    if mounted(mountpoint):
        result = run(["umount", mountpoint], timeout=60, check=False)
        if result.returncode != 0:
            problems.append(f"umount {mountpoint} failed ({result.stderr.strip()}); lazy unmount")
            run(["umount", "-l", mountpoint], timeout=30, check=False)


class Ext4OnNbd:
    """nbdfuse + loop device (+ the ext4 a test puts on it), torn down in reverse on every path."""

    def __init__(self, workdir, uri, size=GiB):
        self.uri = uri
        self.size = size
        self.fuse_dir = os.path.join(workdir, "fuse")
        self.disk = os.path.join(self.fuse_dir, "disk")
        self.mountpoint = os.path.join(workdir, "fs")
        self.pidfile = os.path.join(workdir, "nbdfuse.pid")
        os.makedirs(self.fuse_dir)
        os.makedirs(self.mountpoint)
        self.nbdfuse = Process(
            "nbdfuse", ["nbdfuse", "-P", self.pidfile, self.disk, uri], os.path.join(workdir, "nbdfuse.log")
        )
        self.loop = None
        self.fuse_minor = None

    def attach(self):
        self.nbdfuse.start()
        wait_until(lambda: os.path.exists(self.pidfile) or not self.nbdfuse.alive(), 30, "nbdfuse to be ready")
        assert self.nbdfuse.alive(), f"nbdfuse exited with {self.nbdfuse.returncode()}:\n{self.nbdfuse.log()}"
        assert os.path.getsize(self.disk) == self.size
        self.fuse_minor = os.minor(os.stat(self.fuse_dir).st_dev)
        self.loop = run(["losetup", "--direct-io=on", "-f", "--show", self.disk], timeout=30).stdout.strip()
        assert self.loop.startswith("/dev/loop"), self.loop

    def logs(self):
        return [(self.nbdfuse.name, self.nbdfuse.log())]

    def teardown(self):
        problems = []
        unmount(self.mountpoint, problems)
        if self.loop:
            if run(["losetup", "-d", self.loop], timeout=30, check=False).returncode != 0:
                problems.append(f"losetup -d {self.loop} failed")
            else:
                # The detach is deferred while anyone still has the device open (udev probing
                # it after a change, say); until then it holds the FUSE file open.
                backing = f"/sys/block/{os.path.basename(self.loop)}/loop/backing_file"
                try:
                    wait_until(lambda: not os.path.exists(backing), 30, f"{self.loop} to be detached")
                except AssertionError as e:
                    problems.append(str(e))
            self.loop = None
        if mounted(self.fuse_dir):
            deadline = time.monotonic() + 10
            while (result := run(["fusermount3", "-u", self.fuse_dir], timeout=30, check=False)).returncode != 0:
                if time.monotonic() > deadline:
                    abort_fuse(self.fuse_dir, self.fuse_minor)
                    run(["fusermount3", "-uz", self.fuse_dir], timeout=30, check=False)
                    problems.append(f"fusermount3 -u failed for 10 s ({result.stderr.strip()}); aborted the FUSE connection")
                    break
                time.sleep(0.2)
        code, killed = self.nbdfuse.stop(signal.SIGTERM, timeout=15)
        if killed:
            problems.append("nbdfuse had to be killed")
        return problems


class VolatileDisk:
    """A disk with a volatile write cache, and a file system on it: a sparse image file
    served by nbdkit's file plugin under its cache filter in writeback mode, so a write stays in
    nbdkit's cache until the client flushes (a FLUSH, which the loop device sends for an
    `fsync`), reached through nbdfuse and a loop device. In front of the cache, nbdkit's pause filter:
    `pause()` holds every request from then on, as a disk that stopped answering.

    `power_cut()` kills nbdkit with SIGKILL: every write the disk had not been told to flush is
    gone, and the image holds only what was flushed (and what the cache wrote back on its own,
    as a real disk may). `power_on()` then tears down the dead stack and mounts the image
    itself at the same place, as a machine finds its disk when the power comes back (the file
    system replays its journal or log; ext4 without a journal is checked first, `e2fsck -fy`,
    as a machine does at boot). `fs`: ext4, ext4-nojournal, xfs or btrfs (each as its mkfs makes
    it). Needs root, /dev/fuse, nbdkit, nbdfuse, losetup, the file system's mkfs (and e2fsck)."""

    MKFS = {
        # Inode tables and journal written by mkfs, not lazily through the volatile cache
        # while the test runs.
        "ext4": ["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"],
        "ext4-nojournal": ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=0"],
        "xfs": ["mkfs.xfs", "-q", "-f"],
        "btrfs": ["mkfs.btrfs", "-q", "-f"],
    }

    def __init__(self, workdir, fs="ext4", size=3 * GiB):
        self.workdir = os.path.join(workdir, "volatile-disk")
        os.makedirs(self.workdir)
        self.fs = fs
        # What `mount -t` takes: ext4 with or without its journal.
        self.fs_type = fs.split("-")[0]
        self.size = size
        # What e2fsck said after the cut (ext4-nojournal only).
        self.fsck_output = None
        self.image = os.path.join(self.workdir, "disk.img")
        self.socket = os.path.join(self.workdir, "nbd.sock")
        self.control = os.path.join(self.workdir, "pause.sock")
        # The cache filter keeps its cache in a file under TMPDIR.
        cache_dir = os.path.join(self.workdir, "cache")
        os.makedirs(cache_dir)
        self.nbdkit = Process(
            "nbdkit",
            ["nbdkit", "-f", "-U", self.socket, "--filter=pause", "--filter=cache", "file", self.image,
             "cache=writeback", f"pause-control={self.control}"],
            os.path.join(self.workdir, "nbdkit.log"),
            env=dict(os.environ, TMPDIR=cache_dir),
        )
        self.stack = Ext4OnNbd(os.path.join(self.workdir, "stack"), f"nbd+unix:///?socket={self.socket}", size)
        self.image_loop = None

    @property
    def mountpoint(self):
        return self.stack.mountpoint

    def start(self):
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        # Made on the image before it is served, so that mkfs's own writes are all on it.
        # mkfs.btrfs looks at every mount first and gives up on a FUSE mount whose server is
        # gone (another test's disk between its power cut and its teardown): try again then.
        deadline = time.monotonic() + 60
        while True:
            result = run(self.MKFS[self.fs] + [self.image], timeout=120, check=False)
            if result.returncode == 0:
                break
            if "Transport endpoint is not connected" not in result.stderr or time.monotonic() > deadline:
                raise CommandFailed(f"exit {result.returncode}: {self.MKFS[self.fs][0]}\n{result.stderr}")
            time.sleep(0.5)
        self.nbdkit.start()
        wait_until(lambda: os.path.exists(self.socket) or not self.nbdkit.alive(), 30, "nbdkit to listen")
        assert self.nbdkit.alive(), f"nbdkit exited with {self.nbdkit.returncode()}:\n{self.nbdkit.log()}"
        self.stack.attach()
        run(["mount", "-t", self.fs_type, self.stack.loop, self.mountpoint], timeout=60)
        return self

    def pause(self):
        """Holds every request the disk gets from now on; returns once those before are done."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(self.control)
            s.sendall(b"p")
            assert s.recv(1) == b"P", "the pause filter did not confirm"

    def power_cut(self):
        """The disk loses its cache (nbdkit killed), and the path to it goes at once: the FUSE
        connection is aborted and nbdfuse killed, so that every request still on its way fails
        now. (Left to itself, nbdfuse 1.14 may die of an assertion on the broken connection,
        and requests wait while it dumps core; a process in such a wait outlives SIGKILL.)"""
        self.nbdkit.kill9()
        abort_fuse(self.stack.fuse_dir, self.stack.fuse_minor)
        self.stack.nbdfuse.kill9()

    def power_on(self):
        """After `power_cut()` and once no process holds the file system: the image, as the cut
        left it, mounted where the file system was. Raises if the dead stack would not go
        cleanly (a second mount of the same file system would be refused or worse)."""
        assert not self.nbdkit.alive(), "power_on() after power_cut()"
        problems = self.stack.teardown()
        if problems:
            raise AssertionError(f"the dead disk did not go cleanly: {problems}")
        if self.fs == "ext4-nojournal":
            # Without a journal nothing makes the metadata consistent again but a check; exit
            # 1 and 2 say errors were corrected, 4 and up that some were left.
            result = run(["e2fsck", "-fy", self.image], timeout=300, check=False)
            self.fsck_output = f"e2fsck exit {result.returncode}\n{result.stdout}{result.stderr}"
            if result.returncode not in (0, 1, 2):
                raise AssertionError(f"e2fsck could not repair the file system:\n{self.fsck_output}")
        self.image_loop = run(["losetup", "-f", "--show", self.image], timeout=30).stdout.strip()
        assert self.image_loop.startswith("/dev/loop"), self.image_loop
        run(["mount", "-t", self.fs_type, self.image_loop, self.mountpoint], timeout=60)

    def logs(self):
        fsck = [("e2fsck", self.fsck_output)] if self.fsck_output is not None else []
        return [(self.nbdkit.name, self.nbdkit.log())] + fsck + self.stack.logs()

    def teardown(self):
        """Unmounts and detaches everything, stops nbdkit; returns a list of problems. Never raises."""
        problems = []
        try:
            unmount(self.mountpoint, problems)
            if self.image_loop:
                if run(["losetup", "-d", self.image_loop], timeout=30, check=False).returncode != 0:
                    problems.append(f"losetup -d {self.image_loop} failed")
                self.image_loop = None
            problems += self.stack.teardown()
            self.nbdkit.stop(signal.SIGTERM, timeout=15)
        except Exception as e:  # noqa: BLE001 - teardown must go on
            problems.append(f"teardown: {e}")
        return problems


class ForgetfulDisk:
    """A file system that keeps, when the power goes, no more than POSIX promises: a file's data
    as of its last `fsync`/`fdatasync`, a directory's entries as of its last `fsync`, nothing
    else (`tests/forgetful_fs.py`, a FUSE file system over a directory of this machine). Where
    `VolatileDisk` loses what a real file system had not flushed, this one also loses every
    rename, new name and unlink whose directory was not synced after it, and every write since
    its file's last sync, however the file system around it would have ordered them.

    `power_cut()` kills it with SIGKILL (what it only remembered is gone) and aborts the dead
    connection; `power_on()` then builds, at the same place, the tree the power left. `early`
    (with `seed`): each written page, and each changed directory whole, is also kept at once
    with that probability, as a disk writes back on its own. Needs root, /dev/fuse, fusermount3
    and Debian's python3-pyfuse3."""

    fs = "forgetful"

    def __init__(self, workdir, early=0.0, seed=0):
        self.workdir = os.path.join(workdir, "forgetful-disk")
        self.work = os.path.join(self.workdir, "work")
        self.mountpoint = os.path.join(self.workdir, "fs")
        os.makedirs(self.work)
        os.makedirs(self.mountpoint)
        self.tool = os.path.join(REPO, "tests", "forgetful_fs.py")
        args = ["/usr/bin/python3", self.tool, "serve", self.work, self.mountpoint]
        if early:
            args += ["--early", str(early), "--seed", str(seed)]
        self.server = Process("forgetful_fs", args, os.path.join(self.workdir, "forgetful_fs.log"))
        self.minor = None

    def start(self):
        self.server.start()
        wait_until(lambda: mounted(self.mountpoint) or not self.server.alive(), 30, "the forgetful file system")
        assert self.server.alive(), f"forgetful_fs exited with {self.server.returncode()}:\n{self.server.log()}"
        self.minor = os.minor(os.stat(self.mountpoint).st_dev)
        return self

    def pause(self):
        raise NotImplementedError("ForgetfulDisk cannot hold requests; VolatileDisk can")

    def power_cut(self):
        """Everything not synced is gone, and requests on their way fail now (the FUSE
        connection is aborted, so none waits on the dead server)."""
        self.server.kill9()
        abort_fuse(self.mountpoint, self.minor)

    def power_on(self):
        """After `power_cut()` and once no process holds the file system: what the power left,
        as plain directories and files where the file system was mounted."""
        assert not self.server.alive(), "power_on() after power_cut()"
        run(["fusermount3", "-u", "-z", self.mountpoint], timeout=30, check=False)
        assert not mounted(self.mountpoint), "the dead forgetful mount would not go"
        run(["/usr/bin/python3", self.tool, "materialize", self.work, self.mountpoint], timeout=300)

    def logs(self):
        return [(self.server.name, self.server.log())]

    def teardown(self):
        """Stops the file system and unmounts it; returns a list of problems. Never raises."""
        problems = []
        try:
            if self.server.alive():
                self.server.stop(signal.SIGTERM, timeout=15)
            if mounted(self.mountpoint):
                abort_fuse(self.mountpoint, self.minor)
                if run(["fusermount3", "-u", "-z", self.mountpoint], timeout=30, check=False).returncode != 0:
                    problems.append(f"fusermount3 -u -z {self.mountpoint} failed")
        except Exception as e:  # noqa: BLE001 - teardown must go on
            problems.append(f"teardown: {e}")
        return problems
