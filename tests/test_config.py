"""The host configured from a TOML file behaves as the same settings given
as flags; bad settings are refused with a clear message."""

import json
import os

import pytest

import harness
from conftest import require_tools
from harness import Client, MiB, run


def view(cluster):
    """What must not depend on how the host was configured."""
    status = cluster.status()
    exports = json.loads(
        run(["nbdinfo", "--json", "--list", f"nbd://127.0.0.1:{cluster.nbd_port}"], timeout=60).stdout
    )["exports"]
    return {
        "quorum": status["quorum"],
        "volumes": sorted((v["name"], v["size_bytes"], v["mode"]) for v in status["volumes"]),
        "elements": sorted((e["name"], e["address"], e["state"]) for e in status["elements"]),
        "exports": sorted(
            (e["export-name"], e["export-size"], e["block_size_minimum"], e["block_size_preferred"],
             e["block_size_maximum"], e["can_multi_conn"])
            for e in exports
        ),
    }


@pytest.mark.time_limit(300)
def test_config_file_equals_flags(make_cluster):
    require_tools("nbdinfo")
    cluster = make_cluster(volumes=[("vol0", "1GiB"), ("vol1", "16MiB")])
    from_flags = view(cluster)
    assert from_flags["quorum"] == 2
    assert from_flags["volumes"] == [("vol0", 1 << 30, "read-write"), ("vol1", 16 << 20, "read-write")]
    assert from_flags["elements"] == sorted(
        (e.name, e.address, "in-sync") for e in cluster.elements.values()
    )
    data = harness.random_bytes(1 << 20, seed=5)
    with Client(cluster.uri("vol1")) as client:
        client.pwrite(data, 4096)
        client.flush()

    code, killed = cluster.stop_host()
    assert (code, killed) == (0, False), f"host did not stop cleanly on SIGTERM: exit {code}"
    cluster.use_config = True
    cluster.host.args = cluster.host_args()
    assert "--config" in cluster.host.args
    cluster.start_host()
    assert view(cluster) == from_flags
    with Client(cluster.uri("vol1")) as client:
        assert client.pread(1 << 20, 4096) == data


def host_refuses(workdir, config_text, extra_args=()):
    path = os.path.join(workdir, "bad.toml")
    with open(path, "w") as f:
        f.write(config_text)
    result = run([harness.starfish_bin(), "host", "--config", path, *extra_args], timeout=20, check=False)
    assert result.returncode != 0, f"host accepted a bad configuration:\n{config_text}\n{result.stdout}{result.stderr}"
    message = (result.stdout + result.stderr).strip()
    assert message, "host refused a bad configuration without saying why"
    assert "panicked" not in message, f"host panicked on a bad configuration:\n{message}"
    return message


@pytest.mark.time_limit(120)
def test_bad_configuration_is_refused(make_cluster, workdir):
    cluster = make_cluster(start=False)
    good = cluster.config_toml()
    host_refuses(workdir, good.replace("quorum = 2", "quorum = 4"))
    host_refuses(workdir, good.replace("quorum = 2", "quorum = 0"))
    host_refuses(workdir, good.replace('size = "1GiB"', 'size = "1 parsec"'))
    host_refuses(workdir, good + '\n[[volume]]\nname = "vol0"\nsize = "1MiB"\n')  # duplicate volume
    host_refuses(workdir, good.replace('nbd = "', 'nbd = "not-an-address'))
    host_refuses(workdir, "this is [not toml")
    message = host_refuses(workdir, 'heartbeat_timeout = "100ms"\n' + good)
    assert 'heartbeat timeout "100ms": must be from 1s to 10m' in message, message
    # Two names for one address: one copy would count twice toward the quorum.
    local = cluster.elements["local"].address
    message = host_refuses(workdir, good + f'\n[[element]]\nname = "twin"\naddress = "{local}"\n')
    assert f"elements local and twin have the same address {local}" in message, message
    # 256 volumes, the most a host element serves, leave no room for its catalog of volumes
    # created while running (this was a panic at start).
    more = 256 - good.count("[[volume]]")
    many = "".join(f'\n[[volume]]\nname = "more{i}"\nsize = "1MiB"\n' for i in range(more))
    message = host_refuses(workdir, good + many)
    assert "need 1 to 255 volumes (one more is the catalog" in message, message


@pytest.mark.time_limit(180)
def test_element_and_host_take_every_setting_from_their_files_tls_included(make_cluster, workdir):
    cluster = make_cluster(tls=True, start=False)
    for element in cluster.elements.values():
        path = os.path.join(workdir, f"{element.name}.toml")
        with open(path, "w") as f:
            f.write(f'listen = "{element.address}"\ndata = "{element.data}"\nreplay_log = "64MiB"\n'
                    f'checkpoint_log = "1MiB"\nplaced_writes = true\ntls_dir = "{os.path.join(cluster.certs, element.name)}"\n')
        element.process.args = [harness.starfish_bin(), "element", "--config", path]
    # The host element's TLS directory comes from its file only.
    cluster.host_extra = []
    cluster.use_config = True
    cluster.host.args = cluster.host_args()
    assert "--tls-dir" not in cluster.host.args
    cluster.start()
    with Client(cluster.uri()) as client:
        client.pwrite(b"\x5a" * 8192, 0)
        assert client.pread(8192, 0) == b"\x5a" * 8192
        # `placed_writes`: large writes into holes leave the logs small.
        for at in range(4):
            client.pwrite(bytes([at + 1]) * MiB, (at + 1) * MiB)
        client.flush()
        assert client.pread(MiB, 4 * MiB) == b"\x04" * MiB
    cluster.wait_caught_up()
    sizes = {name: element.log_bytes() for name, element in cluster.elements.items()}
    assert all(size < 2 * MiB for size in sizes.values()), f"logs after 4 MiB of placed writes: {sizes}"
    # `checkpoint_log`: 4 MiB of logged writes (64 KiB each, below the placed size) seal each
    # element's 1 MiB log segment several times.
    before = {name: element.live_segment() for name, element in cluster.elements.items()}
    with Client(cluster.uri()) as client:
        for at in range(64):
            client.pwrite(bytes([at]) * (64 * 1024), at * 64 * 1024)
        client.flush()
    cluster.wait_caught_up()
    sealed = {name: element.live_segment() - before[name] for name, element in cluster.elements.items()}
    assert all(n >= 2 for n in sealed.values()), f"seals after 4 MiB of logged writes: {sealed}"
    # A bad element file is refused with the reason.
    bad = os.path.join(workdir, "bad-element.toml")
    with open(bad, "w") as f:
        f.write('listen = "127.0.0.1:1"\ndata = "/tmp/x"\nreplay = "1GiB"\n')
    result = run([harness.starfish_bin(), "element", "--config", bad], timeout=20, check=False)
    assert result.returncode != 0 and "replay" in result.stderr, result.stderr
    with open(bad, "w") as f:
        f.write('listen = "127.0.0.1:1"\ndata = "/tmp/x"\ncheckpoint_log = "4KiB"\n')
    result = run([harness.starfish_bin(), "element", "--config", bad], timeout=20, check=False)
    assert result.returncode != 0 and "checkpoint log 4KiB" in result.stderr, result.stderr


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_logs_in_a_file_carry_no_colour_codes_and_json_on_request(workdir, log_format):
    """Written to a file (not a terminal), log lines have no ANSI escape codes; with
    `--log-format json` each is one JSON object naming its level, target and fields."""
    port = harness.free_port()
    log_path = os.path.join(workdir, f"element-{log_format}.log")
    args = [harness.starfish_bin(), "element", "--listen", f"127.0.0.1:{port}", "--data",
            os.path.join(workdir, f"data-{log_format}"), "--log-format", log_format]
    # Without NO_COLOR: a file is not a terminal, that alone must turn colour off.
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    element = harness.Process(f"element-{log_format}", args, log_path, env=env)
    element.start()
    try:
        harness.wait_listening(element, port)
    finally:
        code, killed = element.stop()
    assert not killed and code == 0, f"the element stopped with {code}"
    with open(log_path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line and not line.startswith("====")]
    assert lines, "the element logged nothing"
    assert not any("\x1b[" in line for line in lines), lines[:3]
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert all({"timestamp", "level", "target", "fields"} <= set(r) for r in records), records[:3]
        serving = [r for r in records if r["fields"].get("message") == "element serving"]
        assert serving and serving[0]["fields"]["listen"] == f"127.0.0.1:{port}", records
        assert serving[0]["level"] == "INFO"
    else:
        assert any("element serving" in line and f"listen=127.0.0.1:{port}" in line for line in lines), lines
