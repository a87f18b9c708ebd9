"""A user's own model from a file: `magis analyze|optimize path/to/model.py:factory`.

The spec `path/to/model.py:NAME` names a function in a Python file (`path/to/model.py` alone
means `NAME` = `factory`). The file is loaded by its path and runs as `python model.py` would
run it, except that `if __name__ == "__main__":` blocks do not (it is the user's own code:
magis runs it as given; its folder is on `sys.path` while it loads and while NAME runs, so
its sibling modules import). Then NAME is called, and must return

- `(model, batch)`: `model(*batch)` is the loss, a tensor of one element or an output with
  `.loss` (a Hugging Face model given `labels=`); a dict batch is passed as keywords;
- `(model, batch, loss_fn)`: `loss_fn(model, *batch)` (or `loss_fn(model, **batch)`) is the
  loss, the convention of `magis.compile`.

`model` is a `torch.nn.Module`, captured in the mode it is returned in (a new module is in
training mode); `batch` is a tensor, a tuple or list of tensors, or a dict of tensors.

As the zoo's paper-size workloads (`magis.capture.steps.workload_step`), NAME runs inside a
`FakeTensorMode`: the model and batch are built at full size with nothing allocated, in the
default dtype (`dtype=` sets it around the call: `module.to(torch.bfloat16)` does not work on
fake parameters), with `torch.nn.init.trunc_normal_` made data-independent (`building.py`).
The step captured is the zoo's: forward, backward and the zoo's update rule for the step kind
(`--step`, `magis.capture.step_kinds.StepKind`: `sgd`, p -= 1e-3 g, a constant of the graph;
or `adamw-bf16`), so a plan made for a file is made for the same kind of step as one made for
a zoo workload. (`magis.compile` captures the
user's own `torch.optim` optimizer; this is for analysis and planning from the command line.)

A `--batch B` is handed to NAME as `batch=B` when NAME takes a `batch` parameter. `magis run`
calls NAME with real tensors (`real=True`), once its fake capture shows that the step fits. A
step that reads a tensor's value in Python (`.item()`, a boolean-mask index) cannot be captured
on fake tensors: NAME is then called again with real ones, where they fit in half the memory
available, and the step captured for the values read (`magis.capture.specialize`).

Every way this goes wrong is one `ModelFileError` line that names the spec: the file missing
or failing to load, no such function, a result of the wrong shape, a model that is no
`nn.Module`, a batch that is not tensors, a value read while building under fake tensors, a
capture that fails (with the line of the model's code it failed in and the ATen op it failed
at, when torch names one: `magis.capture.source`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from magis.capture.building import (
    data_independent_trunc_normal,
    default_dtype,
    small_constants_real,
)
from magis.capture.host_memory import host_available_memory
from magis.capture.source import failure_site
from magis.capture.step_kinds import (
    DEFAULT_STEP,
    OptimizerSpec,
    StepKind,
    autocast_loss,
    read_step_kind,
)
from magis.capture.trace import Step, capture_training
from magis.errors import MagisError, RandomDrawError, ValueReadError

DEFAULT_FUNCTION = "factory"
_DATA_DEPENDENT = ("DataDependentOutputException", "GuardOnDataDependentSymNode")


class ModelFileError(MagisError):
    """A model file (`path/to/model.py:factory`) that cannot be loaded, called or captured."""


@dataclass(frozen=True)
class ModelSpec:
    """Where a user's model comes from: `path` and the function `function` in it."""

    spec: str  # as given on the command line
    path: Path
    function: str


@dataclass(frozen=True)
class UserModel:
    """What a user's factory built, described as a zoo `Workload` is (name, size, dtype, batch).

    `size` is "paper": the model is built at full size under fake tensors, as the zoo's
    paper-size workloads are."""

    name: str
    model_class: str
    parameters: int
    dtype: torch.dtype
    batch: int  # the leading dimension of the first batch tensor (1 for a 0-dim one)
    size: str = "paper"

    @property
    def description(self) -> str:
        return f"{self.model_class} from {self.name}, {self.parameters:,} parameters"


def is_model_file(name: str) -> bool:
    """Whether a workload name is a model file spec (`model.py:NAME` or `model.py`)."""
    return ".py:" in name or name.strip().endswith(".py")


def parse_spec(spec: str) -> ModelSpec:
    """`path/to/model.py:NAME` (or `path/to/model.py`, NAME `factory`) as a ModelSpec."""
    text = spec.strip()
    if text.endswith(".py"):
        path, function = text, DEFAULT_FUNCTION
    else:
        path, _, function = text.rpartition(":")
    if not function.isidentifier():
        raise ModelFileError(f"{spec}: {function!r} is not a function name (path/to/model.py:NAME)")
    return ModelSpec(spec.strip(), Path(path).expanduser(), function)


@contextlib.contextmanager
def _folder_on_path(folder: Path) -> Iterator[None]:
    """`folder` first on `sys.path` for the block, as `python model.py` puts the script's."""
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def load_module(spec: ModelSpec) -> ModuleType:
    """The model file loaded as a module (its top level runs; `__main__` blocks do not)."""
    path = spec.path
    if not path.is_file():
        where = "is a folder" if path.is_dir() else "not found"
        raise ModelFileError(f"{spec.spec}: {path} {where} (give path/to/model.py:NAME)")
    name = "magis_model_" + re.sub(r"\W", "_", path.resolve().as_posix())
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ModelFileError(f"{spec.spec}: {path} cannot be loaded as Python (name it *.py)")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    try:
        with _folder_on_path(path.resolve().parent):
            loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's file, one line
        sys.modules.pop(name, None)
        raise ModelFileError(f"{spec.spec}: loading {path} failed: {_one_line(exc)}") from exc
    return module


def load_factory(spec: ModelSpec) -> Callable:
    """The function `spec.function` of the model file."""
    module = load_module(spec)
    factory = getattr(module, spec.function, None)
    if factory is None:
        defined = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        )
        listed = ", ".join(defined) if defined else "no functions"
        raise ModelFileError(
            f"{spec.spec}: {spec.path} has no function {spec.function!r} (it defines {listed})"
        )
    if not callable(factory):
        raise ModelFileError(f"{spec.spec}: {spec.function} is {_kind(factory)}, not a function")
    return factory


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _kind(value: object) -> str:
    """`value`'s type with its article: "an int", "a str"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _is_data_dependent(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in _DATA_DEPENDENT:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _factory_kwargs(spec: ModelSpec, factory: Callable, batch: int | None) -> dict:
    if batch is None:
        return {}
    try:
        takes_batch = "batch" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_batch = False
    if not takes_batch:
        raise ModelFileError(
            f"{spec.spec}: --batch {batch} needs {spec.function}() to take a `batch` parameter"
        )
    return {"batch": batch}


def call_factory(
    spec: ModelSpec,
    factory: Callable,
    *,
    batch: int | None = None,
    dtype: torch.dtype | None = None,
    real: bool = False,
    seed: int = 0,
) -> tuple:
    """`factory()` under fake tensors (or real ones with `real`), in `dtype`, seeded. A factory
    that reads a value it computed (under fake tensors there is none) is built again with small
    constants made for real (`small_constants_real`)."""
    try:
        return _run_factory(spec, factory, batch, dtype, real, seed, constants=False)
    except ModelFileError as exc:
        if real or not _is_data_dependent(exc):
            raise
    return _run_factory(spec, factory, batch, dtype, real, seed, constants=True)


def _run_factory(spec, factory, batch, dtype, real, seed, constants: bool) -> tuple:
    kwargs = _factory_kwargs(spec, factory, batch)
    mode = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with (
            _folder_on_path(spec.path.resolve().parent),
            default_dtype(dtype or torch.get_default_dtype()),
            data_independent_trunc_normal(),
            mode,
            small_constants_real() if constants else contextlib.nullcontext(),
        ):
            torch.manual_seed(seed)
            return factory(**kwargs)
    except MagisError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: one line
        site = failure_site(exc)
        at = f" at {site}" if site is not None else ""
        if _is_data_dependent(exc):
            raise ModelFileError(
                f"{spec.spec}: {spec.function}() reads the value of a large tensor while "
                f"building{at} (.item(), .tolist(), a branch on data), which fake tensors "
                "cannot: compute that value from Python numbers"
            ) from exc
        raise ModelFileError(f"{spec.spec}: {spec.function}() raised {_one_line(exc)}{at}") from exc


@dataclass(frozen=True)
class Factored:
    """A factory's result, checked: the model, the batch's tensors and names, the loss."""

    spec: str
    model: torch.nn.Module
    data: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    keywords: bool  # the batch was a dict: tensors are passed by name
    loss_fn: Callable | None


def check_result(spec: ModelSpec, result: object) -> Factored:
    """`result` as (model, batch[, loss_fn]), or a one-line error saying what it is instead."""
    where = f"{spec.spec}: {spec.function}()"
    if not isinstance(result, tuple | list) or len(result) not in (2, 3):
        got = f"{len(result)} values" if isinstance(result, tuple | list) else _kind(result)
        raise ModelFileError(
            f"{where} must return (model, batch) or (model, batch, loss_fn); got {got}"
        )
    model, batch, *rest = result
    loss_fn = rest[0] if rest else None
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(
            f"{where} returned {_kind(model)} as the model; it must be a torch.nn.Module"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(f"{where} returned {_kind(loss_fn)} as loss_fn; it must be callable")
    if isinstance(batch, dict):
        names, values, keywords = tuple(map(str, batch)), tuple(batch.values()), True
    else:
        values = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
        names, keywords = tuple(f"input{i}" for i in range(len(values))), False
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, torch.Tensor):
            raise ModelFileError(
                f"{where}: batch {name} is {_kind(value)}; the batch must be a tensor, "
                "a tuple of tensors or a dict of tensors"
            )
    if not values:
        raise ModelFileError(f"{where} returned an empty batch; give the model's example inputs")
    return Factored(spec.spec, model, values, names, keywords, loss_fn)


def _loss(f: Factored) -> Callable[..., torch.Tensor]:
    """`loss(model, *data)` for capture: the user's loss_fn, or the model's own output."""
    names, keywords, user_loss = f.names, f.keywords, f.loss_fn

    def loss(model: torch.nn.Module, *data: torch.Tensor) -> torch.Tensor:
        args, kwargs = ((), dict(zip(names, data, strict=True))) if keywords else (data, {})
        if user_loss is not None:
            return user_loss(model, *args, **kwargs)
        return _own_loss(f, model(*args, **kwargs))

    return loss


def _own_loss(f: Factored, out: object) -> torch.Tensor:
    """The loss a model returns itself: a one-element tensor, or an output with `.loss`."""
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got = (
        f"a tensor of shape {list(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else (f"{_kind(out)} without .loss")
    )
    raise ModelFileError(
        f"{f.spec}: the model returned {got}, not a loss: return (model, batch, loss_fn) with "
        "loss_fn(model, *batch) giving a scalar"
    )


def capture_factored(spec: ModelSpec, f: Factored, step: StepKind | str = DEFAULT_STEP) -> Step:
    """The training step of a factory's model and batch: forward and loss (under the step
    kind's autocast), backward and the step kind's update rule (`OptimizerSpec`)."""
    kind = read_step_kind(step)
    trained = [n for n, p in f.model.named_parameters() if p.requires_grad]
    if not trained:
        raise ModelFileError(f"{spec.spec}: the model has no parameter that requires a gradient")
    rule = OptimizerSpec(kind.optimizer)
    try:
        return capture_training(
            f.model,
            autocast_loss(_loss(f), kind.autocast),
            f.data,
            rule,
            params=trained,
            data_names=list(f.names),
        )
    except ModelFileError:
        raise
    except MagisError as exc:  # the capture's own line names the op and the source line
        raise ModelFileError(f"{spec.spec}: capturing its training step failed: {exc}") from exc


def _describe(spec: ModelSpec, f: Factored) -> UserModel:
    params = list(f.model.parameters())
    floating = [p.dtype for p in params if p.dtype.is_floating_point]
    first = f.data[0]
    return UserModel(
        name=spec.spec,
        model_class=type(f.model).__name__,
        parameters=sum(p.numel() for p in params),
        dtype=floating[0] if floating else torch.get_default_dtype(),
        batch=first.shape[0] if first.dim() else 1,
    )


def model_file_step(
    name: str,
    batch: int | None = None,
    dtype: torch.dtype | None = None,
    step: StepKind | str = DEFAULT_STEP,
    real: bool = False,
    seed: int = 0,
) -> tuple[UserModel, Step]:
    """Load `name` (`path/to/model.py:NAME`), build its model and batch under fake tensors (real
    ones with `real`) and capture the training step; see the module docstring."""
    spec = parse_spec(name)
    factory = load_factory(spec)
    result = call_factory(spec, factory, batch=batch, dtype=dtype, real=real, seed=seed)
    factored = check_result(spec, result)
    with _folder_on_path(spec.path.resolve().parent):  # the forward may import lazily too
        try:
            captured = capture_factored(spec, factored, step)
        except ModelFileError as exc:
            if real or not _reads_values(exc):
                raise
            _check_real_build_fits(spec, factored, exc)
            result = call_factory(spec, factory, batch=batch, dtype=dtype, real=True, seed=seed)
            factored = check_result(spec, result)
            captured = capture_factored(spec, factored, step)
    return _describe(spec, factored), captured


def _reads_values(exc: ModelFileError) -> bool:
    """A capture that failed only because the step reads a value that fake tensors lack (not a
    random draw's): built for real, it is captured for the value read (`capture.specialize`)."""
    cause = exc.__cause__
    return isinstance(cause, ValueReadError) and not isinstance(cause, RandomDrawError)


def _check_real_build_fits(spec: ModelSpec, f: Factored, failure: ModelFileError) -> None:
    """The fake capture's error, said with what a real build needs, where its weights (four
    times: the model, the trace's copies, gradients, one more for the optimizer) and two copies
    of the batch take more than half the memory available: the rest is for activations."""
    weights = sum(p.numel() * p.element_size() for p in f.model.parameters())
    data = sum(t.numel() * t.element_size() for t in f.data)
    needed, available = 4 * weights + 2 * data, host_available_memory()
    if 2 * needed > available:
        raise ModelFileError(
            f"{failure}; building it for real to capture it for the value read needs about "
            f"{needed / 2**30:.1f} GiB of weights and batch, with {available / 2**30:.1f} GiB "
            "available: make the read tensor arithmetic, or give the factory a smaller model"
        ) from failure.__cause__
