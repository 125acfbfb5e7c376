"""Issue 29: training on a TPU pod slice (multi-host SPMD): every host runs the same command, the mesh spans every
host's chips, host h feeds its own devices the cache rows of rank h of H, and the hosts agree over a gloo group.

No pod can run here: what can is tested — the layout and mesh shape for H hosts x C chips, the backend a host
builds from what its runtime reports (a faked 2-host runtime over 8 XLA:CPU devices, the host-level process group
recorded instead of joined), which rows each host reads, and the refusals. docs/TPU.md says what is untested.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from qat_lora.cache.reader import KDCache, endless_batches
from qat_lora.runtime.distributed import spmd_layout


@pytest.mark.parametrize("hosts,chips", [(1, 1), (1, 8), (2, 4), (4, 4), (8, 8), (16, 4)])
def test_the_mesh_spans_every_chip_of_every_host(hosts, chips):
    for host in range(hosts):
        layout = spmd_layout(host, hosts, chips, hosts * chips)
        assert layout.mesh_shape == (hosts * chips,) and layout.local == chips and layout.host == host


@pytest.mark.parametrize("host,hosts,local,devices", [(0, 2, 4, 4), (2, 2, 4, 8), (0, 2, 0, 0), (0, 3, 4, 8)])
def test_a_layout_that_does_not_add_up_is_refused(host, hosts, local, devices):
    with pytest.raises(ValueError, match="every host of the slice running the same command"):
        spmd_layout(host, hosts, local, devices)


def test_the_hosts_read_together_the_rows_one_process_would(cache_dir):
    # Host h of H reads rows order[h::H] in batches of B: step k's H host batches hold exactly the rows of the one
    # process's step-k batch of H x B (their order differs; the loss is a mean over rows, so the update is equal).
    cache, per_host, seed = KDCache(cache_dir), 4, 3
    for hosts in (2, 4):
        single = endless_batches(cache, per_host * hosts, seed)
        streams = [endless_batches(cache, per_host, seed, rank=h, world_size=hosts) for h in range(hosts)]
        for _ in range(7):  # past an epoch's end too
            together = sorted(row for s in streams for row in map(tuple, next(s)["input_ids"].tolist()))
            assert together == sorted(map(tuple, next(single)["input_ids"].tolist()))


FAKE_POD = """
import json, sys
import torch.distributed as dist
import torch_xla.runtime as xr
host = int(sys.argv[1])
xr.process_index, xr.process_count, xr.addressable_runtime_device_count = lambda: host, lambda: 2, lambda: 4
joined = {}
dist.init_process_group = lambda backend, **kw: joined.update(backend=backend, **{k: str(v) for k, v in kw.items()})
from qat_lora.runtime.sharding import FsdpBackend
backend = FsdpBackend()
spec = backend.input_sharding({"input_ids": 2})["input_ids"]
print("POD " + json.dumps({"rank": backend.rank, "world_size": backend.world_size, "master": backend.is_master,
                           "data_parallel": backend.data_parallel, "mesh": list(backend._mesh.mesh_shape),
                           "minibatch": spec.minibatch, "joined": joined, "describe": backend.describe()}))
"""


@pytest.mark.slow
@pytest.mark.xla
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None and not os.environ.get("CI"),
                    reason="torch_xla not installed (pip install 'qat-lora[xla]')")
@pytest.mark.parametrize("host", [0, 1])
def test_a_host_of_a_two_host_slice_builds_its_backend_from_the_runtime(host):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", FAKE_POD, str(host)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    pod = json.loads(result.stdout.split("POD ", 1)[1])
    assert (pod["rank"], pod["world_size"], pod["master"]) == (host, 2, host == 0)  # only host 0 writes
    assert pod["data_parallel"] == 4  # its batch: --batch-size x its own 4 chips
    assert pod["mesh"] == [8] and pod["minibatch"] is True  # one mesh over both hosts, each feeding its share
    assert pod["joined"]["backend"] == "gloo" and pod["joined"]["init_method"] == "xla://"
    assert (pod["joined"]["rank"], pod["joined"]["world_size"]) == (str(host), "2")
    assert f"host {host} of 2" in pod["describe"] and "over 8 devices" in pod["describe"]
