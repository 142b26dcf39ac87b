"""The Debian package (`cargo deb`, scripts/package.sh) as an operator uses it: it installs
(a `starfish` system user, the binary, the units, the configuration), its units pass
`systemd-analyze verify`, the processes run the way the units start them (systemd is not
PID 1 in a container: their ExecStart, user and state directory are read from the installed
units), `starfish status` answers, an NBD client writes, and removing the package leaves
the data: installed again, the same cluster serves what was written.

It installs a package system-wide, so it skips (touching nothing) on a machine where a
`starfish` package, its user or /var/lib/starfish already exist."""

import configparser
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import time

import pytest

from conftest import require_tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = "/lib/systemd/system"
ADMIN = "127.0.0.1:7100"  # packaging/etc/host.toml
NBD_URI = "nbd://127.0.0.1:10809/vol0"
ELEMENTS = ["1", "2", "3"]


def sh(args, check=True, timeout=120):
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{args} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def installed():
    result = sh(["dpkg-query", "-W", "-f=${Status}", "starfish"], check=False)
    return result.returncode == 0 and "installed" in result.stdout and "not-installed" not in result.stdout


def unit(name):
    """The installed unit's [Service] section (systemd syntax is close enough to INI here)."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    with open(os.path.join(UNITS, name)) as f:
        parser.read_file(f)
    return parser["Service"]


class UnitProcess:
    """A process started the way systemd would start a unit: ExecStart (with the instance
    for `%i`), as its User, with its StateDirectory made and owned, its Environment."""

    def __init__(self, unit_file, instance, log_path):
        service = unit(unit_file)
        expand = lambda text: text.replace("%i", instance)  # noqa: E731
        self.command = expand(service["ExecStart"]).split()
        user = service["User"]
        if "StateDirectory" in service:
            state = os.path.join("/var/lib", expand(service["StateDirectory"]))
            os.makedirs(state, exist_ok=True)
            shutil.chown(state, user, service.get("Group", user))
            os.chmod(state, int(service.get("StateDirectoryMode", "0755"), 8))
        env = dict(os.environ)
        for assignment in service.get("Environment", "").split():
            key, _, value = assignment.partition("=")
            env[key] = value
        self.kill_signal = getattr(signal, service.get("KillSignal", "SIGTERM"))
        self.log = open(log_path, "ab")
        self.process = subprocess.Popen(
            ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *self.command],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self, timeout=60):
        """Stops it as systemd would (KillSignal, then SIGKILL); its exit code (None: killed)."""
        if self.process.poll() is None:
            self.process.send_signal(self.kill_signal)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
                self.log.close()
                return None
        self.log.close()
        return self.process.returncode


def start_cluster(workdir, round):
    processes = [UnitProcess("starfish-element@.service", i, os.path.join(workdir, f"element-{i}-{round}.log"))
                 for i in ELEMENTS]
    processes.append(UnitProcess("starfish-host.service", "", os.path.join(workdir, f"host-{round}.log")))
    return processes


def wait_in_sync(workdir, processes, timeout=60):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in processes:
            assert p.process.poll() is None, f"{p.command} exited with {p.process.returncode}: {logs(workdir)}"
        result = sh(["/usr/bin/starfish", "status", "--admin", ADMIN, "--json"], check=False, timeout=30)
        if result.returncode == 0:
            last = json.loads(result.stdout)
            if [v["mode"] for v in last["volumes"]] == ["read-write"] and all(
                    e["state"] == "in-sync" for e in last["elements"]):
                return last
        time.sleep(0.3)
    raise AssertionError(f"the packaged cluster did not come up in sync in {timeout} s: {last}\n{logs(workdir)}")


def logs(workdir):
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.endswith(".log"):
            with open(os.path.join(workdir, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-3000:]}")
    return "\n".join(out)


def stop_all(processes):
    codes = [p.stop() for p in reversed(processes)]  # the host element first
    return list(reversed(codes))


@pytest.mark.time_limit(240)
def test_the_package_installs_runs_and_leaves_the_data_when_removed(workdir):
    require_tools("dpkg", "dpkg-deb", "systemd-analyze", "setpriv", "qemu-io", "adduser")
    if os.geteuid() != 0:
        pytest.skip("installs a package: needs root")
    if sh(["cargo", "deb", "--version"], check=False).returncode != 0:
        pytest.fail("cargo-deb is missing: run scripts/install-test-deps.sh", pytrace=False)
    existing = [what for what, there in [
        ("a starfish package", installed()),
        ("a starfish user", any(u.pw_name == "starfish" for u in pwd.getpwall())),
        ("/var/lib/starfish", os.path.exists("/var/lib/starfish")),
        ("/etc/starfish", os.path.exists("/etc/starfish")),
    ] if there]
    if existing:
        pytest.skip(f"this machine already has {', '.join(existing)}: not touching it")

    out = os.path.join(workdir, "deb")
    built = sh(["bash", os.path.join(ROOT, "scripts", "package.sh"), "--no-build", "--output", out], timeout=300)
    deb = built.stdout.strip().splitlines()[-1]
    assert deb.endswith(".deb") and os.path.isfile(deb), built.stdout
    contents = sh(["dpkg-deb", "--contents", deb]).stdout
    for path in ["./usr/bin/starfish", f".{UNITS}/starfish-element@.service", f".{UNITS}/starfish-host.service",
                 "./etc/starfish/host.toml", "./etc/starfish/element-1.toml", "./usr/share/doc/starfish/README.md"]:
        assert path in contents, f"{path} not in the package:\n{contents}"
    conffiles = sh(["dpkg-deb", "-I", deb, "conffiles"]).stdout.split()
    assert "/etc/starfish/host.toml" in conffiles and "/etc/starfish/element-3.toml" in conffiles, conffiles

    processes = []
    try:
        sh(["dpkg", "-i", deb])
        assert installed()
        assert pwd.getpwnam("starfish").pw_dir == "/var/lib/starfish"
        # The units as systemd reads them (unknown keys, missing binaries, bad syntax fail).
        verify = sh(["systemd-analyze", "verify", "starfish-element@1.service", "starfish-host.service"], check=False)
        assert verify.returncode == 0, verify.stderr
        assert sh(["/usr/bin/starfish", "--help"]).stdout.startswith("Highly-available")

        processes = start_cluster(workdir, 1)
        status = wait_in_sync(workdir, processes)
        assert status["role"] == "active" and status["quorum"] == 2, status
        sh(["qemu-io", "-f", "raw", "-c", "write -P 0x5c 0 4M", "-c", "write -P 0xa7 900M 1M", NBD_URI])
        codes = stop_all(processes)
        processes = []
        assert codes == [0, 0, 0, 0], f"exit codes {codes} (None: needed SIGKILL)\n{logs(workdir)}"
        data = "/var/lib/starfish/element-1"
        assert os.stat(data).st_uid == pwd.getpwnam("starfish").pw_uid
        held = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(data) for f in fs)

        sh(["dpkg", "-r", "starfish"])
        assert not installed() and not os.path.exists("/usr/bin/starfish")
        assert not os.path.exists(f"{UNITS}/starfish-host.service")
        assert os.path.isfile("/etc/starfish/host.toml"), "configuration is kept until purge"
        left = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(data) for f in fs)
        assert left == held and left >= 5 << 20, f"element data {held} bytes before removal, {left} after"

        # Installed again, the same cluster serves what was written before the removal.
        sh(["dpkg", "-i", deb])
        processes = start_cluster(workdir, 2)
        wait_in_sync(workdir, processes)
        sh(["qemu-io", "-f", "raw", "-c", "read -P 0x5c 0 4M", "-c", "read -P 0xa7 900M 1M", NBD_URI])
        codes = stop_all(processes)
        processes = []
        assert codes == [0, 0, 0, 0], f"exit codes {codes}\n{logs(workdir)}"
    finally:
        stop_all(processes)
        if installed() or os.path.exists("/etc/starfish"):
            sh(["dpkg", "--purge", "starfish"], check=False)
        shutil.rmtree("/var/lib/starfish", ignore_errors=True)
        shutil.rmtree("/etc/starfish", ignore_errors=True)
        if any(u.pw_name == "starfish" for u in pwd.getpwall()):
            sh(["userdel", "starfish"], check=False)
        if any(g.gr_name == "starfish" for g in grp.getgrall()):
            sh(["groupdel", "starfish"], check=False)
