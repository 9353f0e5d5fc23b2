"""The distributed runtime: each edge server a process holding only its experts (Ray actors), hidden
states really moving between them over emulated links, fault handling, load generation.

- `weights`: experts read by key from a safetensors checkpoint;
- `links`: per node-pair latency and bandwidth applied where the bytes move;
- `server`: `ServerCore` (a server's experts), `HomeEngine` (backbone + policy + dispatch), transports;
- `repair`, `health`: re-routing around failed servers, exclusion and readmission with backoff;
- `serve`: Ray start/join (loopback, token auth), one actor per server, the client, closed-loop load;
- `measure`: measured metrics of a run beside the simulator's prediction of the same run;
- `cli`: `serve_command`, mounted as `edgemoe serve`.

Nothing here imports Ray at module import time; Ray is the optional extra `edgemoe[ray]`. Ray reads
its authentication mode when it is imported, so importing this package first switches token
authentication on (RAY_AUTH_MODE=token) unless the environment already chose a mode.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
