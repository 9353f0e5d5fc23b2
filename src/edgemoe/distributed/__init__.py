"""The distributed runtime: each edge server a process holding only its experts (Ray actors), hidden
states really moving between them over emulated links, fault handling, load generation.

- `weights`: experts read by key from a safetensors checkpoint;
- `links`: per node-pair latency and bandwidth applied where the bytes move;
- `server`: `ServerCore` (a server's experts), `HomeEngine` (backbone, passes, requests), transports;
- `layer_step`: one MoE layer of a home's pass (dense time, decision, fan-out through `dispatch`, combination);
- `repair`, `health`: re-routing around failed servers, exclusion and readmission with backoff;
- `serve`: Ray start/join (loopback, token auth), one actor per server, the client, closed-loop load;
- `measure`: measured metrics of a run beside the simulator's prediction of the same run;
- `cli`: `launch` and the load run of `edgemoe serve --backend ray` (options in edgemoe.serve.cli).

Nothing here imports Ray at module import time; Ray is the optional extra `edgemoe[ray]`. Ray reads
its authentication mode when it is imported, so importing this package first switches token
authentication on (RAY_AUTH_MODE=token) unless the environment already chose a mode. It also gives a
starting GCS 180 s instead of Ray's 30 s to come up (RAY_gcs_server_port_wait_time_s), for busy small hosts.


Loopback only by default: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read at import, like the auth mode)
Ray takes 127.0.0.1 as the node address, so every Ray server of a local instance listens on loopback
(checked with `ss -ltn`: nothing else). To join or form a multi-machine cluster, export
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 before starting (see docs/distributed.md).
"""

import os
import sys

# Ray imported before this package read RAY_AUTH_MODE unset (= disabled): start_ray refuses to start then.
RAY_IMPORTED_TOO_EARLY = "ray" in sys.modules and "RAY_AUTH_MODE" not in os.environ
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray waits 30 s by default for a starting GCS to publish its port, and on a small edge server whose cores are busy
# (or a 2-core CI machine compiling numba beside it) the GCS can take longer: the start then fails with "Timed out
# waiting for file .../gcs_server_port". A slow start is not a failure here; an explicit setting wins.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")
