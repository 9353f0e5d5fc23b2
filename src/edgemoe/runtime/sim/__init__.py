"""The simulator backend: the front door (`simulate`), what both engines share (`run`), the fast wave engine
with its job queue and compiled policy rules (`waves`), the reference event loop (`des`) and the workload
(`workload`)."""
