"""The simulator backend: the front door (`simulate`), what both engines share (`run`), the fast wave engine
(`engine`) with its job queue (`jobqueue`), the policies decided in its compiled loop (`rules`: exact,
slimcaching, drop; `ordermoe_loop`), the reference event loop (`des`) and the workload (`workload`)."""
