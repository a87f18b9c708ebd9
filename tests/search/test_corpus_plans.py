"""Plans found on public architectures outside the zoo execute and verify against eager
PyTorch (issue #16): each `:tiny` corpus model, in float64, searched under both limits with
a seed each (two seeds per model; warm starts from the baselines included, as `magis
optimize` runs it)."""

import pytest

from magis.backend import compile_program, verify
from magis.capture import workload_step
from magis.commands.optimize import find_plan, setup_search
from magis.search import SearchOptions

# One per family the issue names: GQA decoder, encoder-decoder, concatenating CNN, diffusion
# U-Net (attention, group norm), windowed attention, two-tower multi-input model.
MODELS = ["llama", "t5", "densenet121", "ddpm_unet", "swin", "clip"]


@pytest.fixture(scope="module", params=MODELS)
def tiny_step(request):
    return workload_step(f"corpus:{request.param}:tiny", float64_when_tiny=True)[1]


@pytest.mark.parametrize(("limit", "seed"), [({"lat_limit": 1.10}, 0), ({"mem_limit": 0.5}, 1)])
def test_plans_on_unseen_models_verify(tiny_step, limit, seed):
    setup = setup_search(tiny_step, **limit)
    plan = find_plan(setup, SearchOptions(max_states=10, seed=seed))
    assert plan.graph.is_valid_schedule(list(plan.order))
    assert plan.summary.memory_ratio <= 1.0 + 1e-9
    program = compile_program(plan.graph, list(plan.order))
    check = verify(tiny_step, program, tiny_step.make_inputs())
    assert check.verified, check
