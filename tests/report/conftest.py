import pytest

from magis.commands.optimize import find_plan, setup_workload_search
from magis.plan import Plan
from magis.search import SearchOptions


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory):
    """A bert-base:tiny plan, searched for 30 states (reproducible), saved."""
    setup = setup_workload_search("bert-base:tiny", mem_limit=0.8)
    plan = find_plan(setup, SearchOptions(max_states=30, time_budget=120))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


@pytest.fixture(scope="session")
def plan(plan_file):
    """The plan of `plan_file`, loaded back."""
    return Plan.load(plan_file)
