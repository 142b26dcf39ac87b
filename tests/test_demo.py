"""`starfish demo`: a whole cluster from one command, for a first look."""

import json
import os
import re
import signal

import pytest

import harness
from conftest import attach_logs, cluster_only, require_tools
from harness import Client, run


@pytest.mark.time_limit(120)
def test_demo_serves_then_exits_by_itself(request, workdir):
    cluster_only()
    require_tools("nbdinfo")
    starfish_bin = request.getfixturevalue("starfish_bin")
    duration = 8
    assert 10809 not in harness.listening_ports(), (
        "port 10809 (the demo's default NBD port) is already in use: is another demo running?"
    )
    demo = harness.Process(
        "demo", [starfish_bin, "demo", "--duration", duration], os.path.join(workdir, "demo.log"), cwd=workdir
    )
    attach_logs(request, type("DemoLogs", (), {"logs": lambda self: [("demo", demo.log())]})())
    demo.start()
    try:
        found = harness.wait_until(
            lambda: re.search(r"nbds?://[^\s']+", harness.tail_file(demo.log_path, 200)) or (
                not demo.alive() and "exited"
            ),
            30,
            "the demo to print an NBD URI",
        )
        assert found != "exited", f"demo exited with {demo.returncode()} before printing a URI"
        uri = found.group(0)
        assert uri.startswith("nbds://"), f"the demo runs with TLS on, but printed {uri}"
        info = json.loads(run(["nbdinfo", "--json", uri], timeout=30).stdout)
        assert info["exports"][0]["export-size"] > 0 and info["TLS"] is True
        with Client(uri, timeout=30) as client:
            client.pwrite(b"demo" * 1024, 0)
            assert client.pread(4096, 0) == b"demo" * 1024
        code = demo.wait(duration + 30)
        assert code == 0, f"demo did not exit 0 by itself after --duration {duration}: {code}"
        port = int(uri.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        assert port not in harness.listening_ports(), "something still listens on the demo's port after it exited"
    finally:
        demo.stop(signal.SIGTERM, timeout=10)
        demo.reap_group()
