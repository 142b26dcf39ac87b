"""Fixtures for the real-process tests: a StarFish cluster per test (three
elements and a host, as subprocesses on 127.0.0.1), per-test time limits,
and the processes' logs attached to every failure report.

Environment:
    STARFISH_BIN                path of the binary (default target/release/starfish)
    STARFISH_TEST_REFERENCE     "nbdkit": run the data-path tests against
                                nbdkit's memory plugin (harness self-check);
                                cluster-only tests are skipped
    STARFISH_TEST_KEEP          keep the temporary directories (for debugging)
    STARFISH_FAILED_LOGS        where a failed test's whole process logs are
                                copied (default target/failed-test-logs): the
                                report shows only their tails
"""

import hashlib
import os
import shutil
import signal
import subprocess

import pytest

import harness

DEFAULT_TIME_LIMIT = 300  # seconds, for a test without its own time_limit mark


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "time_limit(seconds): fail the test if its body runs longer (SIGALRM)"
    )


# The repository the tests run in (pytest's working directory when started by the test command).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the test command itself writes in the repository while the tests run: cargo's build
# output and the background stage's fuzz build. (cargo-fuzz also makes fuzz/artifacts/TARGET/
# when a target starts, but empty, and git lists no empty directory; a crash input saved there
# is named here too, while the fuzz stage fails.) Python's caches are left out below.
TEST_COMMAND_OUTPUT = ("target/", "fuzz/target/")


def repository_changes():
    """The repository's new, ignored and changed paths outside the test command's output, as `git
    status` lists them, each changed tracked file with its content's hash (so that a file already
    edited before the run still counts when a test rewrites it); None outside a git checkout."""
    try:
        status = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--ignored", "--untracked-files=all",
                                 "--no-renames"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if status.returncode != 0:
        return None
    changes = set()
    for line in status.stdout.splitlines():
        path = line[3:]
        if path.startswith(TEST_COMMAND_OUTPUT) or "__pycache__/" in path:
            continue
        if line[:2] not in ("??", "!!"):
            changes.add(f"{line} {file_hash(os.path.join(REPO, path))}")
        else:
            changes.add(line)
    return changes


def file_hash(path):
    """A changed tracked file's content as a short hash, or what stands in its place."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except FileNotFoundError:
        return "(deleted)"
    except IsADirectoryError:
        return "(directory)"


def pytest_sessionstart(session):
    # Only the process that runs the session (not each pytest-xdist worker) looks.
    if not hasattr(session.config, "workerinput"):
        session.config._starfish_repository_before = repository_changes()


def pytest_sessionfinish(session, exitstatus):
    """A test must write in its own directory: one that leaves a file in the repository (fio
    saved its verify state in the working directory once), or changes a tracked one, fails the
    run, naming it."""
    before = getattr(session.config, "_starfish_repository_before", None)
    if before is None:
        return
    after = repository_changes()
    if after is None:
        return
    left = sorted(after - before)
    if left:
        print("\nthe tests left or changed these in the repository (`git status --porcelain --ignored`):")
        for line in left:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


class TestTimeLimit(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    mark = item.get_closest_marker("time_limit")
    seconds = int(mark.args[0]) if mark else DEFAULT_TIME_LIMIT

    def expired(signum, frame):
        raise TestTimeLimit(f"test ran longer than its time limit of {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for source in getattr(item, "_starfish_log_sources", []):
        try:
            for name, text in source.logs():
                report.sections.append((f"log of {name} ({report.when})", text))
        except Exception as e:  # noqa: BLE001 - a report must not fail
            report.sections.append(("logs", f"could not read logs: {e}"))
    kept = keep_whole_logs(item, report.when)
    if kept:
        report.sections.append(("whole logs", f"copied to {kept}"))


def keep_whole_logs(item, when):
    """Copies the whole log files of a failed test's processes (the report holds their
    tails, which a long run of one message can fill) to a directory that outlives the test's
    temporary one; returns that directory, or None if there was nothing to copy."""
    files = []
    for source in getattr(item, "_starfish_log_sources", []):
        files += getattr(source, "log_files", lambda: [])()
    if not files:
        return None
    root = os.environ.get("STARFISH_FAILED_LOGS") or os.path.join(harness.REPO, "target", "failed-test-logs")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in item.nodeid)
    directory = os.path.join(root, f"{safe}-{when}")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, path in files:
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(directory, f"{name}.log"))
    except OSError as e:
        return f"(could not copy: {e})"
    return directory


def attach_logs(request, source):
    """Makes `source.logs()` part of the report if the test fails."""
    sources = getattr(request.node, "_starfish_log_sources", None)
    if sources is None:
        sources = request.node._starfish_log_sources = []
    sources.append(source)


def require_tools(*tools):
    """Skips the test (saying which) if an external tool is not installed."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in tools if shutil.which(t, path=path) is None]
    if missing:
        pytest.skip(f"missing tool(s): {', '.join(missing)} (run scripts/install-test-deps.sh)")


def cluster_only():
    if harness.reference_mode():
        pytest.skip("needs a StarFish cluster; STARFISH_TEST_REFERENCE=nbdkit runs data-path tests only")


@pytest.fixture(scope="session")
def starfish_bin():
    path = harness.starfish_bin()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(
            f"StarFish binary not found at {path}: run `cargo build --release -p starfish` "
            "or set STARFISH_BIN",
            pytrace=False,
        )
    return path


@pytest.fixture
def workdir():
    path = harness.make_workdir()
    yield path
    harness.remove_workdir(path)


@pytest.fixture
def make_cluster(request, workdir):
    """Returns a function that builds and starts a Cluster (keyword arguments
    as Cluster's); every cluster it built is destroyed at teardown."""
    cluster_only()
    request.getfixturevalue("starfish_bin")
    clusters = []

    def make(start=True, **kwargs):
        index = len(clusters)
        directory = os.path.join(workdir, f"cluster{index}")
        os.makedirs(directory)
        cluster = harness.Cluster(directory, **kwargs)
        clusters.append(cluster)
        attach_logs(request, cluster)
        if start:
            cluster.start()
        return cluster

    yield make
    for cluster in clusters:
        cluster.destroy()


@pytest.fixture
def make_linked_cluster(request, workdir):
    """Returns a function that builds and starts a harness.LinkedCluster (the links, then
    Cluster's keyword arguments); every cluster it built is destroyed at teardown."""
    cluster_only()
    request.getfixturevalue("starfish_bin")
    clusters = []

    def make(links, **kwargs):
        directory = os.path.join(workdir, f"linked{len(clusters)}")
        os.makedirs(directory)
        cluster = harness.LinkedCluster(directory, links, **kwargs)
        clusters.append(cluster)
        attach_logs(request, cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.destroy()


@pytest.fixture
def cluster(make_cluster):
    """A started, healthy cluster: elements local/near/far, Q=2, vol0 of 1 GiB."""
    return make_cluster()


@pytest.fixture
def target(request, workdir):
    """An NBD server exporting `vol0` (1 GiB): a StarFish cluster, or nbdkit in
    reference mode. Has .uri(volume), .nbd_port and .host (a harness.Process)."""
    if harness.reference_mode():
        require_tools("nbdkit")
        server = harness.ReferenceServer(workdir)
        attach_logs(request, server)
        try:
            yield server.start()
        finally:
            server.destroy()
    else:
        yield request.getfixturevalue("cluster")


@pytest.fixture
def netns_link(request, workdir):
    """Returns a function that starts an emulated WAN link (harness.NetnsLink keyword
    arguments); every link it started is torn down at teardown."""
    if os.geteuid() != 0 or not os.path.exists("/dev/net/tun"):
        pytest.skip("the emulated WAN link needs root and /dev/net/tun")
    links = []

    def make(**kwargs):
        link = harness.NetnsLink(workdir, **kwargs).start()
        links.append(link)
        attach_logs(request, link)
        return link

    yield make
    for link in links:
        link.destroy()
