"""edgemoe as an inference service: an OpenAI-style HTTP API (FastAPI + uvicorn) over an engine that runs the
real model in one process with a runtime policy deciding every token's MoE layers, batching concurrent
requests continuously (docs/serving.md).

- `setup`: the deployment (model, tokenizer, runtime context; profile and placement made and cached);
- `engine`: continuous batching, per-request sampling, the policy bridge, per-request counts;
- `sampling`, `text`: next-token choice; detokenisation, stop strings and the plain chat template;
- `api`: the FastAPI app; `telemetry`: Prometheus metrics; `service`: app + engine + uvicorn;
- `cli`: `edgemoe serve` and `edgemoe generate`.
"""
