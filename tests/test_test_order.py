"""The order the xdist workers start in (`conftest.lane_order`): a permutation that puts each lane's tests at
the head of the half of the collection its worker is dealt, and names only tests that exist; and what a steal
takes (`conftest.steal_choice`): never a Ray test."""

import importlib.util
import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    """tests/conftest.py as a module of its own (tests/ is not a package, so it cannot be imported by name)."""
    spec = importlib.util.spec_from_file_location("_edgemoe_tests_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CONFTEST = _root_conftest()
FIRST_IN_LANE, lane_order = _CONFTEST.FIRST_IN_LANE, _CONFTEST.lane_order
A = "tests/runtime/policies/test_ordermoe.py::test_tight_and_loose_users_diverge_in_the_simulator_and_stay_within_budget"
B = "tests/runtime/policies/test_field_baselines.py::test_ordermoe_on_error_groups_substitutes_within_those_groups"


def _ids(n: int) -> list[str]:
    return [f"tests/x/test_{i:02d}.py::test_it" for i in range(n)]


def _runs_back_to_front(ran: list[str], starts: list[int]) -> list[str]:
    """The other tests of each part (the part's lane tests left out), read from the last part to the first."""
    bounds = [*starts, len(ran)]
    parts = [[x for x in ran[a:b] if x.startswith("tests/x/")] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [x for part in reversed(parts) for x in part]


def test_each_lane_heads_its_half_and_the_rest_keep_their_order():
    for n in (7, 8, 11):
        ids = _ids(n)
        ids[5:5] = [B, "tests/distributed/test_ray_http.py::t", A, "tests/distributed/test_ray_backend.py::t"]
        order = lane_order(ids)
        assert sorted(order) == list(range(len(ids)))  # nothing dropped or repeated
        ran = [ids[i] for i in order]
        half = len(ids) // 2  # worksteal deals the first worker len // 2 tests
        assert ran[0] == A and ran[half:half + 3] == [B, "tests/distributed/test_ray_backend.py::t",
                                                      "tests/distributed/test_ray_http.py::t"]
        # the second worker goes on with the collection's first tests, the first worker with the ones after them
        assert _runs_back_to_front(ran, [0, half]) == [x for x in ids if x.startswith("tests/x/")]


def test_three_workers_each_head_their_third():
    M = "tests/distributed/test_ray_multinode.py::t"
    for n in (9, 10, 14):
        ids = _ids(n)
        ids[4:4] = [M, B, A, "tests/distributed/test_ray_faults.py::t"]
        order = lane_order(ids, workers=3)
        assert sorted(order) == list(range(len(ids)))
        ran = [ids[i] for i in order]
        first = len(ids) // 3  # worksteal: len // 3, then what is left // 2, then the rest
        second = first + (len(ids) - first) // 2
        assert ran[0] == A and ran[first:first + 2] == [B, "tests/distributed/test_ray_faults.py::t"]
        assert ran[second] == M
        assert _runs_back_to_front(ran, [0, first, second]) == [x for x in ids if x.startswith("tests/x/")]


def test_fewer_workers_than_lanes_share_them_and_parts_without_lanes_hold_runs_of_the_collection():
    M = "tests/distributed/test_ray_multinode.py::t"
    ids = [*_ids(4), M, B, A]
    assert [ids[i] for i in lane_order(ids, workers=2)][:2] == [A, M]  # lane three joins worker one
    assert [ids[i] for i in lane_order(ids, workers=1)] == [A, B, M, *_ids(4)]
    # no lane test collected: the parts (2 + 3, 1 + 2 + 2) hold runs of the collected order, the last part the first run
    assert lane_order(_ids(5)) == [3, 4, 0, 1, 2]
    assert lane_order(_ids(5), workers=3) == [4, 2, 3, 0, 1]


def test_every_lane_entry_names_a_test_that_exists():
    for prefixes in FIRST_IN_LANE:
        for prefix in prefixes:
            path, _, name = prefix.partition("::")
            assert (ROOT / path).exists(), prefix
            if name:
                func = re.sub(r"\[.*\]$", "", name)
                assert re.search(rf"^def {func}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), prefix


steal_choice, NEVER_STOLEN, MIN_QUEUE = _CONFTEST.steal_choice, _CONFTEST.NEVER_STOLEN, _CONFTEST.MIN_QUEUE
RAY = "tests/distributed/test_ray_backend.py::t"


def test_a_steal_takes_half_the_stealable_tail_of_the_longest_and_never_a_ray_test():
    ids = [RAY] * 4 + _ids(6)  # 0-3 are Ray tests, 4-9 ordinary
    assert steal_choice({"a": list(range(10)), "b": []}, ids) == ("a", [7, 8, 9])
    # the victim is the worker with the most stealable tests, not the longest queue
    assert steal_choice({"a": [0, 1, 2, 3, 4], "b": [5, 6, 7, 8], "c": []}, ids) == ("b", [7, 8])
    assert steal_choice({"a": [0, 1, 2, 3], "b": []}, ids) == (None, [])  # only Ray tests left: nothing to take
    assert steal_choice({"a": [0, 4, 5], "b": []}, ids) == ("a", [5])  # leaves the victim MIN_QUEUE tests
    assert steal_choice({"a": [4, 5], "b": []}, ids) == (None, [])
    assert steal_choice({}, ids) == (None, [])


@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(1, 4), st.randoms(use_true_random=False))
def test_a_steal_never_moves_a_ray_test_nor_empties_its_victim(ray_flags, workers, rnd):
    ids = [RAY if ray else f"tests/x/test_{i:02d}.py::t" for i, ray in enumerate(ray_flags)]
    order = list(range(len(ids)))
    rnd.shuffle(order)
    queues = {w: order[w::workers] for w in range(workers)}
    victim, take = steal_choice(queues, ids)
    if victim is None:
        assert take == []
        return
    queue = queues[victim]
    assert take and set(take) <= set(queue) and not any(ids[i].startswith(NEVER_STOLEN) for i in take)
    assert len(queue) - len(take) >= MIN_QUEUE
    stealable = [i for i in queue if not ids[i].startswith(NEVER_STOLEN)]
    assert take == stealable[len(stealable) - len(take):]  # the end of its queue, in order
