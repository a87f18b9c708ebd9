"""A plan file is untrusted input (issue 14): hostile or broken files are refused on load with a
one-line MagisError, and nothing in them is ever executed."""

import copy
import dataclasses
import json
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import magis
from magis.backend import compile_program, generate
from magis.backend.meta_check import check_graph
from magis.cost import get_cost_model
from magis.errors import MagisError
from magis.ir import Graph, PlaceholderKind, TensorMeta
from magis.ir.schema import GraphSchemaError
from magis.ir.serialize import content_digest, graph_from_json, graph_to_json
from magis.ir.topological import place_after_inputs
from magis.rules import SWAP, RuleContext, candidates
from magis.sim import simulate

MARKER = os.path.join(tempfile.gettempdir(), "magis-test-pwned-by-a-plan")
RUN = f"__import__('os').system('touch {MARKER}')"


def _with_a_swap(plan):
    """`plan` with one value swapped out and back (Store/Load): every op kind a plan holds."""
    ctx = RuleContext(
        plan.graph,
        tuple(plan.order),
        simulate(plan.graph, plan.order, get_cost_model("rtx3090")),
        hotspots_only=False,
    )
    swapped = next(candidates([SWAP], ctx)).build()
    order = place_after_inputs(swapped.graph, plan.order, swapped.added)
    return dataclasses.replace(plan, graph=swapped.graph, order=order)


@pytest.fixture(scope="module")
def plan_doc():
    """A real plan: a small GELU MLP's step, searched for 5 states, plus a swap."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        step = magis.training_step(
            model, (x, y), loss_fn=lambda out, x, y: nn.functional.cross_entropy(out, y)
        )
        plan = _with_a_swap(magis.optimize(step, mem_limit=0.9, max_states=5, time_budget=30))
    finally:
        torch.set_default_dtype(old)
    return json.loads(json.dumps(plan.to_json()))


@pytest.fixture(autouse=True)
def no_marker():
    if os.path.exists(MARKER):
        os.remove(MARKER)
    yield
    assert not os.path.exists(MARKER), "a plan file executed code"


def _node(doc, op):
    return next(n for n in doc["graph"]["nodes"] if n["op"] == op)


def _redigest(doc):
    doc["graph"]["digest"] = content_digest(doc["graph"])
    return doc


def _refused(doc, match=None):
    with pytest.raises(MagisError, match=match) as info:
        magis.Plan.from_json(doc)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


def test_the_real_plan_loads_and_round_trips(plan_doc):
    plan = magis.Plan.from_json(copy.deepcopy(plan_doc))
    assert graph_to_json(plan.graph) == plan_doc["graph"]
    assert {"magis.store", "magis.load"} <= {n["op"] for n in plan_doc["graph"]["nodes"]}


def _kwarg_key(doc):
    _node(doc, "aten.sub.Tensor")["kwargs"][f"alpha=0.001, x={RUN}"] = 1


def _kwarg_key_on_gelu(doc):
    _node(doc, "aten.gelu.default")["kwargs"] = {f"x); {RUN}; (": "none"}


def _node_name(doc):
    _node(doc, "aten.gelu.default")["name"] = f"x = {RUN}  #"


def _op_name(doc):
    _node(doc, "aten.gelu.default")["op"] = f"aten.gelu.default({RUN})"


def _op_outside_aten(doc):
    _node(doc, "aten.gelu.default")["op"] = "os.system.default"


def _string_value(doc):
    _node(doc, "aten.gelu.default")["kwargs"] = {"approximate": f"'); {RUN}; ('"}


def _dtype_name(doc):
    _node(doc, "aten.gelu.default")["outputs"][0]["dtype"] = f"float32; {RUN}"


def _dtype_constant(doc):
    _node(doc, "aten.ones_like.default")["kwargs"]["dtype"] = {"dtype": f"{RUN}"}


def _device_constant(doc):
    _node(doc, "aten.ones_like.default")["kwargs"]["device"] = {"device": f"cpu'); {RUN}"}


def _object_constant(doc):
    _node(doc, "aten.sub.Tensor")["kwargs"]["alpha"] = {"__reduce__": RUN}


PAYLOADS = [
    (_kwarg_key, "kwargs: .* is not an argument name"),
    (_kwarg_key_on_gelu, "kwargs"),
    (_node_name, r"\.name: .* is not a node name"),
    (_op_name, r"\.op: .* is not an ATen operator overload"),
    (_op_outside_aten, r"\.op: "),
    (_string_value, r"kwargs\[approximate\]: .* is not a plain word"),
    (_dtype_name, r"outputs\[0\]\.dtype: unknown dtype"),
    (_dtype_constant, "unknown dtype"),
    (_device_constant, "unknown device"),
    (_object_constant, "unreadable value"),
]


@pytest.mark.parametrize("edit, message", PAYLOADS, ids=[e.__name__ for e, _ in PAYLOADS])
def test_injection_payloads_are_refused_on_load(plan_doc, edit, message):
    doc = copy.deepcopy(plan_doc)
    edit(doc)
    # As written by hand: the digest no longer matches.
    _refused(copy.deepcopy(doc), "edited after magis wrote it")
    # With the digest recomputed (anyone can): the schema refuses the field, by its path.
    text = _refused(_redigest(doc), message)
    assert text.startswith("graph.nodes[") or "unknown dtype" in text, text


def test_a_kwargs_key_in_memory_is_refused_by_codegen(tmp_path):
    """A graph built in Python never passed the loader: codegen checks the same fields."""
    g = Graph()
    x = g.add_placeholder("x", TensorMeta((3,), "float64", 8), PlaceholderKind.DATA)
    y = g.add_op(
        "y", "aten.gelu.default", (g.node(x).out(),), {f"x={RUN}": 1}, (g.meta(g.node(x).out()),)
    )
    g.set_outputs([g.node(y).out()])
    with pytest.raises(GraphSchemaError, match="is not an argument name"):
        compile_program(g, g.program_order())


def test_edited_op_and_edited_shape_are_caught_by_the_digest(plan_doc):
    doc = copy.deepcopy(plan_doc)
    _node(doc, "aten.gelu.default")["op"] = "aten.relu.default"
    _refused(doc, "graph.digest: the plan's graph was edited after magis wrote it")
    doc = copy.deepcopy(plan_doc)
    _node(doc, "aten.mm.default")["outputs"][0]["shape"][0] += 1
    _refused(doc, "re-run magis optimize")


@pytest.mark.parametrize("document", [[1, 2, 3], "plan", None, 7, {}])
def test_documents_of_the_wrong_shape_are_one_line_errors(document):
    with pytest.raises(MagisError) as info:
        graph_from_json(document)
    assert "\n" not in str(info.value)
    _refused(document)


# --- fuzzing ---------------------------------------------------------------------------------

PAYLOAD_VALUES = [
    RUN,
    f"x); {RUN}; (",
    "aten.relu.default",
    "aten.gelu.default",
    "aten.mm.default",
    "magis.store",
    "placeholder",
    "op",
    "weight",
    "float32",
    "int64",
    "__class__",
    "",
    -1,
    0,
    1,
    3,
    2**70,
    1.5,
    float("nan"),
    float("inf"),
    True,
    None,
    [],
    {},
    [1, 2, 3],
    [[0, 0]],
    {"ref": [0, 0]},
    {"ref": [10**6, 0]},
    {"ref": [0, 5]},
    {"tuple": [1, 2]},
    {"dtype": "float32"},
    {"dtype": RUN},
    {"float": "inf"},
    {"float": RUN},
    {"device": "cpu"},
    {"memory_format": "channels_last"},
    {"__reduce__": RUN},
    {"shape": [2], "dtype": "float64", "itemsize": 8, "strides": [1]},
]


def _paths(value, prefix=()):
    """Every position inside a JSON document, containers included."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _mutate(doc, path, kind, payload, other):
    """One edit at `path`: replace by a payload, by another part of the document, by its own
    string form, move an integer by one (most such files still load), delete it, or add an
    unknown key or element beside it."""
    if not path:
        return payload if kind == "replace" else doc
    parent, key = _get(doc, path[:-1]), path[-1]
    if kind == "replace":
        parent[key] = copy.deepcopy(payload)
    elif kind == "swap":
        parent[key] = copy.deepcopy(other)
    elif kind == "nudge" and type(parent[key]) is int:
        parent[key] += 1 if payload else -1
    elif kind == "stringify":
        parent[key] = json.dumps(parent[key])
    elif kind == "delete":
        del parent[key]
    elif kind == "add" and isinstance(parent, dict):
        parent[f"extra_{key}"] = copy.deepcopy(payload)
    elif kind == "add":
        parent.append(copy.deepcopy(payload))
    return doc


@st.composite
def mutated_plans(draw, base):
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        # Most edits go to the graph, where a plan's code comes from.
        graph_paths = [p for p in paths if p[:1] == ("graph",)] or paths
        path = draw(st.sampled_from(graph_paths if draw(st.integers(0, 9)) else paths))
        kind = draw(st.sampled_from(["replace", "swap", "stringify", "nudge", "delete", "add"]))
        payload = draw(st.sampled_from(PAYLOAD_VALUES))
        other = _get(doc, draw(st.sampled_from(paths)))
        doc = _mutate(doc, path, kind, payload, other)
    if draw(st.booleans()) and isinstance(doc, dict) and isinstance(doc.get("graph"), dict):
        doc["graph"]["digest"] = content_digest(doc["graph"])  # an edit that fakes its digest
    return doc


def _load_and_generate(doc) -> bool:
    """True when the document loads (its code is then generated and compiled, never run);
    False when it is refused with a one-line MagisError. Anything else fails the test."""
    try:
        plan = magis.Plan.from_json(doc)
        source = generate(plan.graph, plan.order)
        compile_program(plan.graph, plan.order)
    except MagisError as exc:
        assert "\n" not in str(exc), str(exc)
        return False
    assert "__import__" not in source
    check_graph(plan.graph)  # odd but well-formed graphs: a report, never an exception
    return True


# 1000 keep `make test` quick; MAGIS_FUZZ_EXAMPLES=10000 for a longer run.
FUZZ_EXAMPLES = int(os.environ.get("MAGIS_FUZZ_EXAMPLES", "1000"))


def test_mutated_plans_load_or_are_refused_and_never_execute(plan_doc):
    """Thousands of edited plan files: each loads to a valid graph or raises a one-line
    MagisError; none raises anything else, none runs anything (the marker stays absent)."""
    outcomes = []

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mutated_plans(plan_doc))
    def check(doc):
        outcomes.append(_load_and_generate(doc))
        assert not os.path.exists(MARKER)

    check()
    assert len(outcomes) >= min(FUZZ_EXAMPLES, 500)
    assert not all(outcomes), "no mutation was ever refused: the fuzzer does not reach the schema"
