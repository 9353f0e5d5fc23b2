"""SlimCaching (the paper's planner): the K = 1 lazy greedy (`k1`), the per-node value tables (`values`),
the max-convolution DP over layers (`maxconv`), the local refinement (`refine`), the upper bounds (`bounds`),
several models on one cluster (`multimodel`) and the planner that joins them (`planner`)."""
