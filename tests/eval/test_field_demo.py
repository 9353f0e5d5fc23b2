"""The demo's comparison carries the field's baselines, each calibrated to the operating point for itself."""

from __future__ import annotations


def test_demo_comparison_lists_every_field_baseline_at_both_points():
    from edgemoe.eval.experiment import FIELD_BASELINES, ordermoe_comparison

    comp = ordermoe_comparison()
    names = {m.name for m in comp.methods}
    for policy in ("skip", "reroute", "random-local", "ordermoe-error-groups"):
        assert {f"{policy}-paper", f"{policy}-strict"} <= names
    assert set(comp.self_calibrated) == {m.name for m in FIELD_BASELINES}
    # on OrderMoE's placement for the same point
    assert all(m.placement == "ordermoe" and m.placement_params["budget"] == m.policy_params["budget"]
               for m in FIELD_BASELINES)


def test_self_calibrated_methods_get_their_own_budget(tiny_comparison_inputs):
    from edgemoe.eval.experiment import Comparison, ExperimentConfig, MethodSpec, run_comparison

    adapter, profile, text = tiny_comparison_inputs
    comp = Comparison(
        name="t", cluster="edge8", mode="migrate",
        methods=(MethodSpec("tight", "ordermoe", "ordermoe", {"budget": "tight", "horizon": 0},
                            placement_params={"budget": "tight"}),
                 MethodSpec("skip-tight", "ordermoe", "skip", {"budget": "tight"}, placement_params={"budget": "tight"})),
        operating_points=(("tight", 0.02),), calibrate_method="tight", self_calibrated=("skip-tight",))
    cfg = ExperimentConfig(model="tiny", num_requests=4, prompt_tokens=4, gen_tokens=4, block_len=24)
    doc = run_comparison(adapter, profile, comp, text, cfg, log=lambda _: None)
    cal_doc = doc["operating_points"]
    own = cal_doc["self_calibrated"]["skip-tight"]
    assert own["calib_ppl_rel_increase_upper95"] <= 0.02 or own["budget"] == 1e-3
    methods = doc["methods"] if isinstance(doc["methods"], dict) else {m["name"]: m for m in doc["methods"]}
    point = cal_doc["points"]["tight"]["budget"]
    assert methods["skip-tight"]["policy_params"]["budget"] == own["budget"]  # its own calibration ...
    assert methods["skip-tight"]["placement_params"] == {"budget": point}  # ... on OrderMoE's placement for the point
    assert methods["tight"]["policy_params"]["budget"] == point
