"""magis.compile: a user's model, optimizer and loss trained through a plan, equal to eager
PyTorch (float64, relative error <= 1e-9), and the one-line errors of bad input (issue #15)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from train_helpers import TOL, eager_step, fresh_batch, one_thread, train_both, worst_difference

import magis.train.step as step_module
from magis.capture.corpus import build_case
from magis.errors import CaptureError, MagisError, PlanError
from magis.train import BatchError, CompileError, OptimizerError, compile, compile_program_order

SEARCH = {"time_budget": 2.0, "hardware": "rtx3090"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class Net(nn.Module):
    """Linear, ReLU, batch norm, linear; a frozen layer and a parameter the loss never reads.

    The ReLU comes before the batch norm so that every trained parameter has a true gradient: a
    bias right before a batch norm has none (the norm removes any shift), so it moves only by
    rounding noise, which AdamW's eps amplifies into differences of 1e-9 that depend on the plan
    the time-bounded search happened to reach."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.inp(self.frozen(x)))))


def net_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def example() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(64, 8, generator=gen), torch.randint(0, 4, (64,), generator=gen)


@pytest.fixture
def net(float64) -> Net:
    torch.manual_seed(0)
    return Net()


def compiled(loss_fn=net_loss, batch=None, clip=1.0, **kw):
    def make(model, opt):
        return compile(
            model,
            opt,
            batch if batch is not None else example(),
            loss_fn=loss_fn,
            mem_limit=0.5,
            clip_grad_norm=clip,
            **{**SEARCH, **kw},
        )

    return make


def test_adamw_param_groups_warmup_and_cosine_equal_eager(net):
    """Two param groups with their own lr and weight decay; a warm-up from lr 0 (no update where
    exp_avg_sq is 0) into a cosine schedule; the unused parameter gets no state, as in torch."""

    def make_opt(m):
        return torch.optim.AdamW(
            [
                {"params": [m.inp.weight, m.out.weight, m.unused], "weight_decay": 0.1},
                {"params": [m.inp.bias, m.out.bias, *m.norm.parameters()], "lr": 3e-2},
            ],
            lr=1e-2,
        )

    def make_sched(opt):
        def factor(s: int) -> float:
            return s / 3 if s < 3 else 0.5 * (1 + math.cos(math.pi * (s - 3) / 17))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    loss_err, (err, where), step = train_both(
        net, make_opt, net_loss, example(), compiled(), make_sched=make_sched
    )
    assert loss_err <= TOL and err <= TOL, where
    assert step.step.untrained == ("unused",)
    assert net.unused not in step.optimizer.state


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("adam", {"lr": 1e-2, "weight_decay": 0.05, "betas": (0.8, 0.99)}),
        ("adam", {"lr": 1e-2, "weight_decay": 0.05, "decoupled_weight_decay": True}),
        ("sgd", {"lr": 0.1}),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2}),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    ],
)
def test_optimizers_equal_eager_over_20_steps(net, kind, kw):
    """Adam's bias correction follows the real step count (it was frozen at step 1 before)."""
    cls = torch.optim.Adam if kind == "adam" else torch.optim.SGD
    loss_err, (err, where), _ = train_both(
        net,
        lambda m: cls(m.parameters(), **kw),
        net_loss,
        example(),
        compiled(clip=None),
        clip=None,
        make_sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.5),
    )
    assert loss_err <= TOL and err <= TOL, where


def test_measured_peak_is_the_simulated_peak_and_the_program_is_built_once(net, monkeypatch):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    step = compiled(measure=True)(net, opt)

    def no_recompile(*args, **kwargs):
        raise AssertionError("a call compiled the program again")

    monkeypatch.setattr(step_module, "compile_program", no_recompile)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        step(*fresh_batch(example(), gen))
        assert step.last_peak_bytes == step.simulated_peak_bytes


def test_checkpoint_and_resume_through_a_saved_plan(tmp_path, float64):
    """Stop at step 10 (model, optimizer and scheduler state_dicts, the plan), resume in new
    objects through plan=: the same as twenty uninterrupted steps."""
    case = build_case("gpt2")
    gen = torch.Generator().manual_seed(5)
    batches = [fresh_batch(case.batch, gen) for _ in range(20)]

    def make(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)

    def run(step, sched, part):
        for b in part:
            step(*b)
            sched.step()

    whole = copy.deepcopy(case.model)
    opt_w, sched_w = make(whole)
    step_w = compile(whole, opt_w, case.batch, loss_fn=case.loss_fn, mem_limit=0.5, **SEARCH)
    run(step_w, sched_w, batches)

    first = copy.deepcopy(case.model)
    opt_1, sched_1 = make(first)
    step_1 = compile(first, opt_1, case.batch, loss_fn=case.loss_fn, mem_limit=0.5, **SEARCH)
    run(step_1, sched_1, batches[:10])
    torch.save(
        {"model": first.state_dict(), "opt": opt_1.state_dict(), "sched": sched_1.state_dict()},
        tmp_path / "ckpt.pt",
    )
    plan_path = step_1.plan.save(tmp_path / "plan.json")

    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed = build_case("gpt2", seed=99).model  # other weights until the checkpoint loads
    resumed.load_state_dict(ckpt["model"])
    opt_2, sched_2 = make(resumed)
    opt_2.load_state_dict(ckpt["opt"])
    sched_2.load_state_dict(ckpt["sched"])
    step_2 = compile(resumed, opt_2, case.batch, loss_fn=case.loss_fn, plan=plan_path)
    run(step_2, sched_2, batches[10:])
    err, where = worst_difference(resumed, opt_2, whole, opt_w)
    assert err <= TOL, where


def test_batch_as_keyword_arguments_and_the_models_own_loss(float64):
    """Without loss_fn the model's output `.loss` is the loss; the batch comes as keywords."""
    case = build_case("gpt2")
    ids, labels = case.batch
    eager = copy.deepcopy(case.model)
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9)
    eopt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    step = compile(  # no positional batch: example_batch defaults to ()
        case.model,
        opt,
        example_kwargs={"input_ids": ids, "labels": labels},
        lat_limit=1.1,
        **SEARCH,
    )
    for _ in range(3):
        loss = step(input_ids=ids, labels=labels)
        ref = eager_step(
            eager, eopt, lambda m, i, t: m(input_ids=i, labels=t).loss, (ids, labels), None
        )
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)  # the LM head: float32 loss
    err, where = worst_difference(case.model, opt, eager, eopt)
    assert err <= TOL, where


def test_a_dict_batch_that_fails_capture_names_example_kwargs():
    """A keyword batch given as one dict positional argument fails in the model's forward; the
    one-line error says to pass it as example_kwargs=."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"input_ids": torch.randint(0, 10, (2, 3))}
    with pytest.raises(CaptureError, match="example_kwargs="):
        compile(model, opt, batch, loss_fn=lambda m, b: m(b).sum(), lat_limit=1.1, **SEARCH)


@pytest.mark.parametrize("planned", [False, True])
def test_autocast_bf16_runs_the_same_casts(planned):
    """Compiled inside torch.autocast: the forward in bfloat16 as eager autocast runs it, backward
    and update in float32 (the parameters' dtype). In program order the casts and ops are eager's
    own; a plan's rewrites (a split matmul adds its bfloat16 parts) round as bfloat16 does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eopt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    x, y = torch.randn(128, 16), torch.randint(0, 4, (128,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if planned:
            step = compile(model, opt, (x, y), loss_fn=net_loss, mem_limit=0.5, **SEARCH)
        else:
            step = compile_program_order(model, opt, (x, y), loss_fn=net_loss)
    assert any("bfloat16" in n for n in step.step.input_names)
    assert any(
        step.step.graph.node(n).outputs[0].dtype == "bfloat16" for n in step.step.graph.ops()
    )
    tol = 1e-2 if planned else 1e-6
    for _ in range(5):
        loss = step(x, y)
        eopt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = net_loss(eager, x, y)
        ref.backward()
        eopt.step()
        assert loss.dtype == ref.dtype == torch.float32
        assert loss.item() == pytest.approx(ref.item(), rel=tol)
    err, where = worst_difference(model, opt, eager, eopt)
    assert err <= tol, where


# --- bad input: one line each -----------------------------------------------------------------


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert text and "\n" not in text, text
    return text


@pytest.fixture
def net_step(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return compiled(time_budget=0.2)(net, opt)  # the errors come before the plan matters


@pytest.mark.parametrize(
    "batch, says",
    [
        ((torch.randn(5, 8), torch.randint(0, 4, (5,))), "compiled for float64[64, 8]"),
        ((torch.randn(64, 8).float(), torch.randint(0, 4, (64,))), "is float32[64, 8]"),
        ((torch.randn(64, 8, device="meta"), torch.randint(0, 4, (64,))), "on meta"),
        ((torch.randn(64, 8),), "compiled for arguments"),
    ],
)
def test_a_batch_of_other_shape_dtype_or_device_is_one_line(net_step, batch, says):
    with pytest.raises(BatchError) as exc:
        net_step(*batch)
    assert says in one_line(exc)


def test_a_branch_on_a_random_draw_is_one_line(float64):
    """A branch on a tensor's value is captured for the value read (`test_specialize.py`); one
    on a random draw cannot be: the next step draws another."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            y = self.lin(x)
            return y.relu() if torch.rand(()) > 0.5 else y.tanh()

    model = Branchy()
    with pytest.raises(CaptureError) as exc:
        compile(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            example(),
            loss_fn=net_loss,
            mem_limit=0.5,
        )
    assert "depends on a random draw" in one_line(exc)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda ps: torch.optim.RMSprop(ps), "supports torch.optim.SGD, torch.optim.Adam"),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad=True is not supported"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize=True"),
        (lambda ps: torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), "not parameters"),
    ],
)
def test_unsupported_optimizers_are_one_line(net, make, says):
    with pytest.raises(OptimizerError) as exc:
        compile(net, make(net.parameters()), example(), loss_fn=net_loss, mem_limit=0.5)
    assert says in one_line(exc)


def test_an_optimizer_whose_structure_changed_is_one_line(net_step):
    net_step.optimizer.param_groups[0]["momentum"] = 0.9
    with pytest.raises(OptimizerError) as exc:
        net_step(*example())
    assert "changed from plain to momentum" in one_line(exc)


@pytest.mark.parametrize(
    "limits", [{}, {"mem_limit": 0.5, "lat_limit": 1.1}, {"mem_limit": 0.5, "plan": "p.json"}]
)
def test_both_or_neither_limit_is_one_line(net, limits):
    with pytest.raises(CompileError) as exc:
        compile(
            net, torch.optim.SGD(net.parameters(), lr=0.1), example(), loss_fn=net_loss, **limits
        )
    assert "mem_limit" in one_line(exc)


def test_a_plan_made_for_another_model_or_optimizer_is_one_line(net_step, tmp_path, float64):
    path = net_step.plan.save(tmp_path / "plan.json")
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(PlanError) as exc:
        compile(
            other,
            torch.optim.SGD(other.parameters(), lr=0.1),
            example(),
            loss_fn=net_loss,
            plan=path,
        )
    one_line(exc)
    same = copy.deepcopy(net_step.model)
    momentum = torch.optim.SGD(same.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(PlanError) as exc:
        compile(same, momentum, example(), loss_fn=net_loss, plan=path, clip_grad_norm=1.0)
    assert "momentum" in one_line(exc)


def test_hardware_cuda_without_a_gpu_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from magis.cost import get_cost_model

    with pytest.raises(MagisError) as exc:
        get_cost_model("cuda")
    assert "no CUDA device" in one_line(exc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_step_on_cuda_equals_eager_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double().cuda()
    x, y = (t.cuda() for t in example())
    x = x.double()
    loss_err, (err, where), step = train_both(
        model,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        net_loss,
        (x, y),
        compiled(batch=(x, y), hardware="cuda"),
    )
    assert step.device.type == "cuda"
    assert loss_err <= TOL and err <= TOL, where


def test_cuda_graph_needs_a_gpu(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(BatchError) as exc:
        compile_program_order(net, opt, example(), loss_fn=net_loss, cuda_graph=True)
    assert "needs a model on a GPU" in one_line(exc)
    step = compile_program_order(net, opt, example(), loss_fn=net_loss)
    assert not step.cuda_graph and step.captured_peak_bytes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_graph_replay_trains_as_generated_code_and_recaptures_moved_state():
    """Graphed and op-by-op steps of one plan (with Store/Load) stay equal over several calls,
    and an optimizer state replaced in between (load_state_dict) is captured again."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)).double().cuda()]
    models.append(copy.deepcopy(models[0]))
    x, y = (t.cuda() for t in example())
    x = x.double()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    steps = [
        compile(
            m,
            o,
            (x, y),
            loss_fn=net_loss,
            mem_limit=0.6,
            time_budget=2.0,
            hardware="rtx3090",
            cuda_graph=g,
        )  # fmt: skip
        for m, o, g in zip(models, opts, (True, False), strict=True)
    ]
    assert steps[0].cuda_graph and not steps[1].cuda_graph
    for i in range(4):
        if i == 2:
            opts[0].load_state_dict(copy.deepcopy(opts[0].state_dict()))
        losses = [s(x, y) for s in steps]
        assert torch.equal(losses[0], losses[1])
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    assert steps[0]._graphed.captures == 2 and steps[0].captured_peak_bytes > 0
