"""Cost models: roofline presets, the fission property, memoization, the profiled SQLite cache."""

from __future__ import annotations

import math
import pickle
import sqlite3
import warnings

import numpy as np
import pytest
import torch

from magis.capture.trace import capture
from magis.cost import (
    HARDWARE_PRESETS,
    CostModel,
    Hardware,
    ProfiledCostModel,
    RooflineModel,
    UnitCostModel,
    get_cost_model,
)
from magis.cost import store as store_module
from magis.cost.base import OpCall, op_key
from magis.cost.links import Interconnect, get_link
from magis.cost.pace import TTL_S, Pace, is_stale
from magis.cost.profiled import Disturbance, time_call
from magis.cost.store import default_cache_path
from magis.errors import MagisWarning, UnknownHardwareError
from magis.ir import Graph, PlaceholderKind, Ref, TensorMeta


def f32(*shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), "float32", 4)


def mm_graph(m: int, k: int, n: int, parts: int = 1) -> Graph:
    """(m x k) @ (k x n) split along m into `parts` mms run one after another (F-Trans)."""
    g = Graph()
    a = g.add_placeholder("a", f32(m // parts, k), PlaceholderKind.DATA)
    b = g.add_placeholder("b", f32(k, n), PlaceholderKind.DATA)
    for i in range(parts):
        g.add_op(f"mm{i}", "aten.mm.default", (Ref(a), Ref(b)), outputs=(f32(m // parts, n),))
    return g


def add_graph(numel: int) -> Graph:
    g = Graph()
    a = g.add_placeholder("a", f32(numel), PlaceholderKind.DATA)
    g.add_op("add", "aten.add.Tensor", (Ref(a), Ref(a)), outputs=(f32(numel),))
    return g


@pytest.fixture(scope="module")
def small_step():
    return capture(lambda a, b: (a @ b).relu().sum(), torch.randn(8, 8), torch.randn(8, 8))


@pytest.fixture(scope="module")
def view_step():
    return capture(
        lambda a, b: (a.t() @ b.view(8, 8)).relu().sum(), torch.randn(8, 8), torch.randn(64)
    )


def fission_ratio(model: CostModel, size: int, parts: int) -> float:
    return model.total_time(mm_graph(size, size, size, parts)) / model.total_time(
        mm_graph(size, size, size)
    )


# --- roofline --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rtx3090", "a100", "h100"])
def test_presets_exist_and_times_are_positive(name):
    model = get_cost_model(name)
    assert isinstance(model, RooflineModel) and model.name == name
    assert isinstance(HARDWARE_PRESETS[name], Hardware)
    times = model.node_times(mm_graph(128, 128, 128))
    assert times[2] > 0 and np.isfinite(times).all()
    assert model.transfer_time(1 << 20) > 0


def test_default_hardware_is_the_papers_card():
    assert RooflineModel().hardware.name == "rtx3090"


@pytest.mark.parametrize("name", ["rtx3090", "a100", "h100"])
def test_bigger_ops_take_longer(name):
    model = get_cost_model(name)
    mms = [model.total_time(mm_graph(s, s, s)) for s in (64, 256, 1024, 4096)]
    adds = [model.total_time(add_graph(n)) for n in (1 << 10, 1 << 16, 1 << 22, 1 << 26)]
    assert mms == sorted(mms) and len(set(mms)) == len(mms)
    assert adds == sorted(adds) and len(set(adds)) == len(adds)


@pytest.mark.parametrize("name", ["rtx3090", "a100", "h100"])
def test_fission_costs_little_for_large_ops_and_much_for_small_ones(name):
    """MAGIS §2.3: splitting lowers utilization; a few percent for a big mm, several x for a tiny one."""
    model = get_cost_model(name)
    large = fission_ratio(model, 4096, 2)
    small = fission_ratio(model, 64, 8)
    assert 1.005 < large < 1.10
    assert small > 4.0
    assert fission_ratio(model, 4096, 8) > large  # more parts, more overhead


def test_rtx3090_large_mm_is_near_tf32_peak():
    hw = HARDWARE_PRESETS["rtx3090"]
    seconds = RooflineModel(hw).total_time(mm_graph(4096, 4096, 4096))
    ideal = 2 * 4096**3 / hw.matmul_flops.float32
    assert ideal < seconds < 1.1 * ideal


def test_roofline_transfer_time_uses_host_bandwidth():
    hw = HARDWARE_PRESETS["rtx3090"]
    assert RooflineModel(hw).transfer_time(10**9) == pytest.approx(
        10**9 / hw.host_bandwidth, rel=1e-3
    )
    assert RooflineModel(hw).transfer_time(0) == 0.0


# --- the contract ----------------------------------------------------------------------------


def test_placeholders_and_views_cost_nothing(view_step):
    g = view_step.graph
    model = get_cost_model("rtx3090")
    times = model.node_times(g)
    views = [n for n in g.ops() if g.info(n).is_view]
    assert views, "the example should capture view ops"
    for nid in views + g.placeholders():
        assert model.op_time(g, nid) == 0.0 and times[nid] == 0.0
    for nid in g.ops():
        if not g.info(nid).is_view:
            assert times[nid] > 0


def test_node_times_is_indexed_by_node_id_with_gaps():
    g = mm_graph(64, 64, 64, parts=3)
    g.remove_node(3)
    model = UnitCostModel()
    times = model.node_times(g)
    assert times.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]


class CountingModel(RooflineModel):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def estimate(self, call: OpCall) -> float:
        self.calls += 1
        return super().estimate(call)


def test_identical_ops_are_estimated_once():
    g = mm_graph(256, 256, 256, parts=4)  # four identical mm configurations
    model = CountingModel()
    first = model.node_times(g)
    model.node_times(g)
    assert model.calls == 1
    assert model.cache_info().entries == 1 and model.cache_info().computed == 1
    assert first[2] == first[3] == first[4] == first[5] > 0
    model.node_times(mm_graph(128, 256, 256, parts=2))  # another graph, same configuration
    assert model.calls == 1


def test_memo_key_covers_shapes_dtypes_and_constants():
    g = Graph()
    a = g.add_placeholder("a", f32(4, 4), PlaceholderKind.DATA)
    s1 = g.add_op("s1", "aten.sum.dim_IntList", (Ref(a), [0]), outputs=(f32(4),))
    s2 = g.add_op("s2", "aten.sum.dim_IntList", (Ref(a), [1]), outputs=(f32(4),))
    s3 = g.add_op("s3", "aten.sum.dim_IntList", (Ref(a), [1]), outputs=(f32(4),))
    assert op_key(g, s1) != op_key(g, s2)
    assert op_key(g, s2) == op_key(g, s3)
    hash(op_key(g, s1))


def test_unit_cost_model():
    model = get_cost_model("unit")
    assert isinstance(model, UnitCostModel) and model.name == "unit"
    assert model.total_time(mm_graph(8, 8, 8, parts=2)) == 2.0
    assert model.transfer_time(3_000_000_000) == 3.0


def test_unknown_hardware_is_a_one_line_error():
    with pytest.raises(UnknownHardwareError) as info:
        get_cost_model("tpu")
    message = str(info.value)
    assert message == "unknown hardware 'tpu'; choose one of rtx3090, a100, h100, cpu, cuda, unit"


# --- profiled --------------------------------------------------------------------------------


def profiled(tmp_path, name: str = "ops.sqlite", **kw) -> ProfiledCostModel:
    """A profiled model on a cache in `tmp_path`; with no pace known unless given one, so that
    a second instance reads back every time whatever the machine's load meanwhile."""
    kw.setdefault("pace", lambda: 0.0)
    return ProfiledCostModel(cache_path=tmp_path / name, warmup=1, repeats=3, **kw)


def forbid_measuring(monkeypatch):
    def boom(self, call):
        raise AssertionError(f"measured {call.op} again")

    monkeypatch.setattr(ProfiledCostModel, "_measure", boom)


def test_profiled_measures_a_captured_graph(tmp_path, small_step):
    g = small_step.graph
    model = profiled(tmp_path)
    seen = []
    total = model.profile_graph(g, progress=lambda done, n: seen.append((done, n)))
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) == total + 1
    info = model.profile_info()
    assert (
        info.measured == total > 0 and info.fallbacks == () and info.path == tmp_path / "ops.sqlite"
    )
    times = model.node_times(g)
    assert all(0 < times[n] < 0.1 for n in g.ops() if not g.info(n).is_view)


def test_second_instance_reads_the_cache_without_measuring(tmp_path, small_step, monkeypatch):
    g = small_step.graph
    first = profiled(tmp_path)
    expected = first.node_times(g)
    first.close()
    forbid_measuring(monkeypatch)
    second = profiled(tmp_path)
    assert second.profile_info().loaded == first.profile_info().measured
    np.testing.assert_array_equal(second.node_times(g), expected)
    assert second.profile_info().measured == 0


def test_cache_keys_include_the_device(tmp_path, small_step, monkeypatch):
    profiled(tmp_path).profile_graph(small_step.graph)
    monkeypatch.setattr("magis.cost.profiled.device_name", lambda device: "another machine")
    assert profiled(tmp_path).profile_info().loaded == 0


def test_an_op_that_cannot_run_falls_back_to_the_roofline_once(tmp_path, monkeypatch):
    g = Graph()
    a = g.add_placeholder("a", f32(16, 16), PlaceholderKind.DATA)
    bad = g.add_op("bad", "aten.no_such_op.default", (Ref(a),), outputs=(f32(16, 16),))
    model = profiled(tmp_path)
    seconds = model.op_time(g, bad)
    assert math.isfinite(seconds) and seconds > 0
    assert model.profile_info().fallbacks == ("aten.no_such_op.default",)
    forbid_measuring(monkeypatch)  # remembered, in this instance and on disk
    assert model.op_time(g, bad) == seconds
    assert profiled(tmp_path).op_time(g, bad) == seconds


def test_corrupted_cache_is_moved_aside_and_rebuilt(tmp_path, small_step):
    path = tmp_path / "ops.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.warns(MagisWarning, match="corrupt") as record:
        model = ProfiledCostModel(cache_path=path, warmup=1, repeats=3)
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert (tmp_path / "ops.sqlite.corrupt").read_bytes().startswith(b"this is not")
    assert model.total_time(small_step.graph) > 0
    model.close()
    with sqlite3.connect(path) as conn:  # the fresh file is a real cache now
        assert conn.execute("SELECT COUNT(*) FROM op_times").fetchone()[0] > 0


def test_unwritable_cache_path_degrades_to_memory(tmp_path, small_step):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a regular file")
    with pytest.warns(MagisWarning, match="in memory"):
        model = ProfiledCostModel(cache_path=blocker / "ops.sqlite", warmup=1, repeats=3)
    assert model.profile_info().path is None
    assert model.total_time(small_step.graph) > 0


def test_locked_cache_degrades_to_memory(tmp_path, small_step, monkeypatch):
    path = tmp_path / "ops.sqlite"
    monkeypatch.setattr(store_module, "LOCK_TIMEOUT_S", 0.05)
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.warns(MagisWarning, match="locked"):
            model = ProfiledCostModel(cache_path=path, warmup=1, repeats=3)
        assert model.total_time(small_step.graph) > 0
    finally:
        holder.rollback()
        holder.close()


def test_memory_cache_is_silent(small_step):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ProfiledCostModel(cache_path=":memory:", warmup=1, repeats=3)
        assert model.total_time(small_step.graph) > 0


def test_cache_location_follows_magis_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MAGIS_CACHE", str(tmp_path / "dir"))
    assert default_cache_path() == tmp_path / "dir" / "op_cache.sqlite"
    monkeypatch.setenv("MAGIS_CACHE", str(tmp_path / "mine.sqlite"))
    assert default_cache_path() == tmp_path / "mine.sqlite"
    model = get_cost_model("cpu", warmup=1, repeats=3)
    assert isinstance(model, ProfiledCostModel) and model.name == "cpu"
    assert model.profile_info().path == tmp_path / "mine.sqlite"


def test_profiled_transfer_time_is_measured_once_and_grows(tmp_path, monkeypatch):
    model = profiled(tmp_path)
    small, big = model.transfer_time(1 << 10), model.transfer_time(1 << 30)
    assert 0 < small < big
    model.close()
    monkeypatch.setattr(ProfiledCostModel, "_measure_transfer", lambda self: 1 / 0)
    assert profiled(tmp_path).transfer_time(1 << 30) == big


def test_times_measured_on_a_busier_machine_are_taken_again(tmp_path, small_step, monkeypatch):
    g = small_step.graph
    busy = profiled(tmp_path, pace=lambda: 1.0)  # the reference workload took 1 s then
    expected = busy.node_times(g)
    measured = busy.profile_info().measured
    busy.close()
    with monkeypatch.context() as m:  # as busy now, or a little less: every time is read back
        forbid_measuring(m)
        again = profiled(tmp_path, pace=lambda: 0.4)
        np.testing.assert_array_equal(again.node_times(g), expected)
        assert again.profile_info().loaded == measured and again.profile_info().retaken == 0
        # a quiet machine's rows are kept on a busy one: they are the better measurement
        assert profiled(tmp_path, pace=lambda: 5.0).profile_info().retaken == 0
    quiet = profiled(tmp_path, pace=lambda: 0.25)  # four times as fast: the rows are stale
    assert quiet.profile_info().retaken == measured > 0
    assert quiet.profile_info().loaded == 0
    quiet.node_times(g)
    assert quiet.profile_info().measured == measured
    quiet.close()
    with sqlite3.connect(tmp_path / "ops.sqlite") as conn:  # replaced, with the new pace
        paces = {
            p for (p,) in conn.execute("SELECT pace FROM op_times WHERE key NOT LIKE 'scratch:%'")
        }
    assert paces == {0.25}
    forbid_measuring(monkeypatch)
    assert profiled(tmp_path, pace=lambda: 0.25).profile_info().loaded == measured


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_profiled_model_goes_to_a_search_worker_with_its_times(
    tmp_path, small_step, monkeypatch, where
):
    """`--hardware cpu --workers 2` pickles the model: the worker reopens the cache file or
    gets the rows of one held in memory, and measures nothing the parent measured."""
    g = small_step.graph
    path = tmp_path / "ops.sqlite" if where == "file" else ":memory:"
    model = ProfiledCostModel(cache_path=path, warmup=1, repeats=3, pace=lambda: 0.0)
    model.profile_graph(g)
    expected = model.node_times(g)
    link = Interconnect(get_link("pcie"), 4)
    model.interconnect = link
    forbid_measuring(monkeypatch)
    worker = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(worker.node_times(g), expected)
    assert worker.interconnect == link and worker.profile_info().measured == 0


def test_the_pace_is_read_again_only_when_its_reading_is_old():
    readings, clock = iter([2e-5, 3e-5]), [0.0]
    timer_calls = []

    def timer(fn, samples):
        fn()  # the reference workload runs
        timer_calls.append(samples)
        return next(readings)

    pace = Pace(lambda: None, timer, clock=lambda: clock[0])
    assert pace.read() == pace.read() == 2e-5 and len(timer_calls) == 1
    clock[0] += TTL_S + 0.1
    assert pace.read() == 3e-5 and len(timer_calls) == 2
    assert is_stale(1.0, 0.25) and not is_stale(1.0, 0.4) and not is_stale(0.0, 1e-9)
    real = Pace(Disturbance(), lambda fn, samples: time_call(fn, 1, samples))
    assert 0 < real.read() < 1.0  # a few small ops on this CPU


def test_a_cache_of_another_schema_is_cleared(tmp_path, small_step):
    path = tmp_path / "ops.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE op_times (key TEXT, seconds REAL)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ProfiledCostModel(cache_path=path, warmup=1, repeats=3)
        assert model.total_time(small_step.graph) > 0
    assert model.profile_info().path == path


def test_ops_too_large_for_the_device_are_estimated(tmp_path, monkeypatch):
    monkeypatch.setattr("magis.cost.profiled.device_memory", lambda device: 4000.0)
    model = profiled(tmp_path)
    seconds = model.total_time(mm_graph(64, 64, 64))  # 48 KiB of tensors > 4000 / 4 bytes
    assert math.isfinite(seconds) and seconds > 0
    assert model.profile_info().fallbacks == ("aten.mm.default",)
    assert model.profile_info().measured == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_on_cuda(tmp_path, small_step):
    model = ProfiledCostModel(device="cuda", cache_path=tmp_path / "gpu.sqlite")
    assert model.total_time(small_step.graph) > 0
    assert model.transfer_time(1 << 20) > 0


def test_convolution_backward_costs_its_two_kernels():
    """dgrad and wgrad run as separate kernels (cuDNN, oneDNN): one call costs what the two
    calls with the split masks cost, so splitting it in the graph is latency-neutral."""
    from magis.capture import training_step
    from magis.cost.roofline import RTX3090, roofline_time

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 3, padding=1)
    )
    step = training_step(model, (torch.randn(8, 3, 64, 64),), loss_fn=lambda out, x: out.mean())
    g = step.graph
    nid = next(
        n
        for n in g.ops()
        if g.node(n).op == "aten.convolution_backward.default" and g.node(n).args[10][0]
    )
    key = op_key(g, nid)
    call = OpCall(key, g.info(nid))
    nothing = TensorMeta((0,), "float32", 4)
    dgrad = key._replace(args=(*key.args[:10], (True, False, False)))
    dgrad = dgrad._replace(outputs=(key.outputs[0], nothing, nothing))
    wgrad = key._replace(args=(*key.args[:10], (False, True, True)))
    wgrad = wgrad._replace(outputs=(nothing, *key.outputs[1:]))
    parts = [roofline_time(RTX3090, OpCall(k, call.info)) for k in (dgrad, wgrad)]
    assert roofline_time(RTX3090, call) == pytest.approx(sum(parts))
    assert min(parts) > 0.2 * sum(parts)  # both do real work


def test_an_op_reading_another_kernels_workspace_is_estimated_not_run(tmp_path):
    """oneDNN's LSTM backward reads its forward's workspace, which synthetic inputs made from
    the metadata (0 bytes) cannot hold: run, it crashed the process; it gets the roofline."""
    from magis.capture.trace import training_step

    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 8, batch_first=True)
    step = training_step(model, (torch.randn(4, 6, 8),), loss_fn=lambda out, x: out[0].sum())
    profiled_model = profiled(tmp_path)
    profiled_model.profile_graph(step.graph)
    assert profiled_model.profile_info().fallbacks == ("aten.mkldnn_rnn_layer_backward.default",)


def test_a_gather_reads_the_rows_it_gathers_and_a_scatter_add_rewrites_them():
    """index_select reads one table element per output element (not the table), so its parts
    along the index move what the whole moves but for the index; index_add also reads and
    writes the output element each source element adds into (MAGIS §4 prices fission by the
    simulator: a split of message passing must not look dearer than the rows it moves)."""
    from magis.ir.ops import build_default_registry, bytes_moved

    registry = build_default_registry()
    table, edges, width = 1_000, 64_000, 16
    nodes = TensorMeta((table, width), "float32", 4)

    def index(n: int) -> TensorMeta:
        return TensorMeta((n,), "int64", 8)

    def rows(n: int) -> TensorMeta:
        return TensorMeta((n, width), "float32", 4)

    gather = registry.lookup("aten.index_select.default")
    whole = bytes_moved(gather, (nodes, 0, index(edges)), {}, (rows(edges),))
    assert whole == index(edges).nbytes + 2 * rows(edges).nbytes
    parts = 8 * bytes_moved(gather, (nodes, 0, index(edges // 8)), {}, (rows(edges // 8),))
    assert parts == whole
    add = registry.lookup("aten.index_add.default")
    args = (nodes, 0, index(edges), rows(edges))
    scattered = bytes_moved(add, args, {}, (nodes,))
    assert scattered == 2 * nodes.nbytes + index(edges).nbytes + 3 * rows(edges).nbytes
    embedding = registry.lookup("aten.embedding.default")
    tokens = bytes_moved(embedding, (nodes, index(10)), {}, (rows(10),))
    assert tokens < nodes.nbytes  # ten tokens do not read the whole vocabulary
