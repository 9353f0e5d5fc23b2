# The two commands of the README. Each creates .venv and installs what is missing, so a fresh
# machine needs nothing but Python 3.11.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test setup lint results

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray,serve]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/edgemoe demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

# Every committed results file, regenerated one after another with the commands that made them, then the
# README's generated block. The time it takes: README, "Where each results file was made".
BENCH := speed.simulator speed.sim_scale speed.policies speed.planners speed.profile_speed speed.ordermoe_scale speed.ordermoe_planner \
	studies.ordermoe_placement studies.scaling studies.adaptive studies.lookahead studies.slim_sweeps studies.upcycle studies.ladder studies.equal_quality \
	ray.ray_sweep ray.ray_failover speed.serving ray.serving_ray tools.exact_stop
BACKLOG_PAPER := ordermoe-H0,ordermoe-H2,ordermoe-H2-now,ordermoe-H2-off,ordermoe-H2-priced,oracle
results: $(STAMP)
	$(BIN)/edgemoe demo --out bench/results/demo
	$(BIN)/edgemoe demo --backend ray --out bench/results/demo-ray
	$(BIN)/edgemoe demo --scenario paper-scale --out bench/results/paper-scale
	$(BIN)/edgemoe profile --model default --data shared:../shared/data --tokens 50000 --out runs/prof \
		--report bench/results/default_model
	$(BIN)/edgemoe profile --model default-upcycled --data shared:../shared/data --tokens 50000 --out runs/prof-upcycled \
		--report bench/results/default_upcycled_model
	# calibration.json first: the ordermoe-full methods read it (studies.equal_quality and every equal_quality
	# run below, full_policy_diagnosis)
	$(BIN)/python -m bench.studies.calibration
	for m in $(BENCH); do $(BIN)/python -m bench.$$m || exit 1; done
	# the fastest of 5 runs per row (the script's default, named as bench/results/backlog_cost.json records it)
	$(BIN)/python -m bench.speed.backlog_cost --repeat 5
	$(BIN)/python -m bench.ray.runtime --quick
	$(BIN)/python -m bench.ray.serving_soak --streams 64 --minutes 10 --warmup-s 60
	$(BIN)/python -m bench.ray.serving_soak --streams 16 --minutes 3 --warmup-s 30 --out bench/results/serving_soak_warmup30.json
	$(BIN)/python -m bench.studies.equal_quality --models default-upcycled --out bench/results/equal_quality_token.json \
		--note "issue 19 section 2: ordermoe-token on default-upcycled alone (equal_quality.json holds it for both models once rerun)"
	$(BIN)/python -m bench.studies.equal_quality --quick --models default --out bench/results/equal_quality_token_quick.json
	$(BIN)/python -m bench.studies.equal_quality --models upcycled-diverged --out bench/results/equal_quality_ladder_diverged.json \
		--note "issue 19 section 5: the ladder's upcycled-diverged model at the default token counts (4096 evaluation, 2048 calibration)"
	$(BIN)/python -m bench.studies.equal_quality --models finegrained-shared --out bench/results/equal_quality_ladder_finegrained.json \
		--note "issue 19 section 5: the ladder's finegrained-shared model at the default token counts (4096 evaluation, 2048 calibration)"
	$(BIN)/python -m bench.studies.equal_quality --models default-upcycled,default,upcycled-diverged,finegrained-shared \
		--methods ordermoe-full --dial-method ordermoe-full --dial-beyond --out bench/results/equal_quality_full.json --reuse bench/results/equal_quality.json \
		bench/results/equal_quality_ladder_diverged.json bench/results/equal_quality_ladder_finegrained.json
	$(BIN)/python -m bench.studies.served_dial
	$(BIN)/python -m bench.studies.equal_quality --models default-upcycled,default,upcycled-diverged,finegrained-shared \
		--methods ordermoe-full-h0 --dial-method ordermoe-full --out bench/results/equal_quality_full_h0.json \
		--reuse bench/results/equal_quality_full.json
	$(BIN)/python -m bench.studies.dial_diagnosis
	$(BIN)/python -m bench.studies.latency_floor
	$(BIN)/python -m bench.studies.full_policy_diagnosis
	$(BIN)/python -m bench.studies.ladder --curve
	$(BIN)/python -m bench.studies.lookahead --quick --budgets 0.05,0.2 --clusters testbed8,edge8
	$(BIN)/python -m bench.studies.lookahead --backlog-horizons 2 --backlogs off,now --out bench/results/lookahead_backlog.json
	$(BIN)/python -m bench.speed.policies --setups L=16 --policies 'ordermoe(H=0),ordermoe(H=2),ordermoe(H=3)'
	$(BIN)/python -m bench.speed.policies --setups 'edge8 L=8' --rows 1,64 --out policies_decode.json
	$(BIN)/python -m bench.speed.policies --setups L=32,generate --policies 'ordermoe(H=2)' --rows 1,64 \
		--out policies_decode_large.json
	$(BIN)/python -m bench.studies.out_of_sample --ilp-nodes 1
	# bench/results/backlog_scenarios.json, one part per command
	$(BIN)/python -m bench.studies.backlog_paper qwen1.5-moe-a2.7b olmoe $(BACKLOG_PAPER)
	$(BIN)/python -m bench.studies.backlog_paper mixtral-8x7b mixtral $(BACKLOG_PAPER)
	$(BIN)/python -m bench.studies.backlog_demo default migrate,home
	$(BIN)/python -m bench.studies.backlog_demo default-upcycled migrate,home
	$(BIN)/python -m bench.studies.backlog_scaling default-upcycled 4,8,16,32
	# bench/results/lookahead_seeds.json: the same scenarios' H=2 / H=0 over 10 workload seeds
	$(BIN)/python -m bench.studies.lookahead_seeds
	# the same at the exact event order (window 0), and each scenario's error at the default 1 ms waves
	$(BIN)/python -m bench.studies.lookahead_seeds --window-s 0 --out bench/results/lookahead_seeds_exact.json
	$(BIN)/python -m bench.studies.window_error
	# bench/results/paper_diagnosis.json: what the queue term changes at paper scale, per decode pass
	$(BIN)/python -m bench.studies.paper_diagnosis
	$(BIN)/python -m bench.studies.paper_diagnosis --window-s 0 --out bench/results/paper_diagnosis_exact.json
	# bench/results/backlog_diagnosis.json: where H=2 loses to H=0, per layer
	$(BIN)/python -m bench.studies.backlog_diagnosis default demo:paper,demo:strict
	$(BIN)/python -m bench.studies.backlog_diagnosis default-upcycled 4:strict,4:paper,8:paper,8:strict,16:paper,16:strict,32:paper,32:strict,demo:paper,demo:strict
	# bench/results/lookahead_diagnosis.json: where H=2 loses to H=0 on the 32-layer Mixtral routing (edge8, 0.05)
	$(BIN)/python -m bench.studies.lookahead_diagnosis edge8 0.05
	# bench/results/lookahead_memory.json: the look-ahead tables' bytes and peak memory, beside the layout before 2026-12-07
	$(BIN)/python -m bench.speed.lookahead_memory --before 527404e
	$(BIN)/python -m bench.tools.test_time
	$(BIN)/python -m bench.tools.tables --write
