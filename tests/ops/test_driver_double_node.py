"""The driver double's node (tests/support/cuda_double/devices.c): its GPUs, what a process sees of
them through CUDA_VISIBLE_DEVICES, their SMs, capability and UUIDs, and peer links per pair.

Each case loads the double in a process of its own, with the environment it reads when it loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import cuda_double
import pytest

_PROBE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
assert lib.cuInit(0) == 0
count, value, raw = ctypes.c_int(), ctypes.c_int(), ctypes.create_string_buffer(16)
assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0
seen = []
for dev in range(count.value):
    assert lib.cuDeviceGetUuid_v2(raw, dev) == 0
    attrs = []
    for number in (16, 75, 76):
        assert lib.cuDeviceGetAttribute(ctypes.byref(value), number, dev) == 0
        attrs.append(value.value)
    seen.append([raw.raw.hex(), *attrs])
peers = []
if count.value > 1:
    for attribute in (2, 3):
        assert lib.cuDeviceGetP2PAttribute(ctypes.byref(value), attribute, 0, 1) == 0
        peers.append(value.value)
    assert lib.cuDeviceCanAccessPeer(ctypes.byref(value), 0, 1) == 0
    peers.append(value.value)
    peers.append(lib.cuDeviceGetP2PAttribute(ctypes.byref(value), 3, 1, 1))  # a device with itself
print(json.dumps({"seen": seen, "peers": peers, "beyond": lib.cuDeviceGet(ctypes.byref(value), count.value)}))
"""


def _probe(**env: str | None) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVER_DOUBLE_", "CUDA_VISIBLE"))}
    environment.update({k: v for k, v in env.items() if v is not None})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PROBE), cuda_double.build()],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_node_has_eight_h100s_each_its_own_uuid_all_peers_with_native_atomics() -> None:
    node = _probe()
    assert [gpu[1:] for gpu in node["seen"]] == [[132, 9, 0]] * 8
    assert len({gpu[0] for gpu in node["seen"]}) == 8
    assert node["peers"] == [1, 1, 1, 101]  # access, native atomics, can access; itself: INVALID_DEVICE
    assert node["beyond"] == 101


def test_visible_devices_are_the_listed_gpus_in_order_cut_at_the_first_bad_entry() -> None:
    every = [gpu[0] for gpu in _probe()["seen"]]
    assert [gpu[0] for gpu in _probe(CUDA_VISIBLE_DEVICES="5,2")["seen"]] == [every[5], every[2]]
    assert [gpu[0] for gpu in _probe(CUDA_VISIBLE_DEVICES="3,9,1")["seen"]] == [every[3]]  # 9: no such GPU
    assert [gpu[0] for gpu in _probe(CUDA_VISIBLE_DEVICES="4,4")["seen"]] == [every[4]]  # repeated
    assert _probe(CUDA_VISIBLE_DEVICES="")["seen"] == []


@pytest.mark.parametrize(("links", "peers"), [("pcie", [1, 0, 1, 101]), ("none", [0, 0, 0, 101])])
def test_a_pcie_box_has_peer_access_without_native_atomics(links: str, peers: list[int]) -> None:
    node = _probe(DRIVER_DOUBLE_LINKS=links, DRIVER_DOUBLE_GPUS="4", DRIVER_DOUBLE_SMS="108", DRIVER_DOUBLE_CC="8.0")
    assert [gpu[1:] for gpu in node["seen"]] == [[108, 8, 0]] * 4
    assert node["peers"] == peers
