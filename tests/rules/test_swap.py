"""Store/Load: executed and verified; the device peak falls, the host pool holds the bytes."""

import torch

from magis.backend import compile_program, measure, verify
from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.ir import Ref
from magis.ir.ops import LOAD_OP, STORE_OP
from magis.sim import simulate


def _swap_first_far_hotspot(graph, order, sim, distance=50):
    pos = {n: i for i, n in enumerate(order)}
    for spot in sim.hotspots:
        x = spot.storage
        late = [
            u
            for u in graph.users(x.node)
            if x in graph.node(u).inputs and pos[u] - pos[x.node] > distance
        ]
        if late:
            break
    user = late[0]
    meta = graph.meta(x)
    st = graph.add_op(f"store_{spot.name}", STORE_OP, (x,), outputs=(meta,))
    ld = graph.add_op(f"load_{spot.name}", LOAD_OP, (Ref(st),), outputs=(meta,))
    graph.replace_uses(x, Ref(ld), [user])
    new = list(order)
    new.insert(new.index(x.node) + 1, st)  # Store as early as possible
    new.insert(new.index(user), ld)
    return new, meta.nbytes


def test_swapped_program_verifies_and_simulator_matches_measurement():
    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    graph = step.graph.copy()
    order = graph.program_order()
    cost = get_cost_model("rtx3090")
    before = simulate(graph, order, cost)
    new_order, nbytes = _swap_first_far_hotspot(graph, order, before)
    assert graph.is_valid_schedule(new_order)
    program = compile_program(graph, new_order)
    assert "store(" in program.source and "load(" in program.source
    inputs = step.make_inputs()
    assert verify(step, program, inputs).verified
    measured = measure(program, step.program_inputs(inputs), repeats=1)
    after = simulate(graph, new_order, cost)
    assert after.peak_bytes == measured.peak_bytes < before.peak_bytes
    assert after.host_peak_bytes == measured.host_peak_bytes == nbytes
    assert after.copy_s > 0


def test_copies_overlap_compute_on_a_gpu_but_not_on_a_cpu():
    """A GPU's copy engines hide a Store/Load behind compute; on the host it is a memcpy by
    the computing threads, so the roofline's CPU preset adds its whole time."""
    from magis.cost.roofline import CPU, RooflineModel

    _, step = workload_step("bert-base:tiny", dtype=torch.float64)
    graph = step.graph.copy()
    order = graph.program_order()
    gpu = get_cost_model("rtx3090")
    new_order, _ = _swap_first_far_hotspot(graph, order, simulate(graph, order, gpu))
    hidden = simulate(graph, new_order, gpu)
    assert hidden.latency_s < hidden.compute_s + hidden.copy_s
    cpu = RooflineModel(CPU)
    assert not cpu.copies_overlap and gpu.copies_overlap
    serial = simulate(graph, new_order, cpu)
    assert serial.latency_s == serial.compute_s + serial.copy_s


def test_a_workspace_larger_than_its_metadata_is_not_swapped():
    """oneDNN's LSTM workspace is 0 bytes by its metadata and 28 KiB by its storage: a Load
    would be simulated at 0 bytes while the real copy holds it all, so it is not swapped; the
    layer's output, an ordinary tensor, is."""
    from magis.capture.trace import training_step
    from magis.rules.swap import swappable

    torch.manual_seed(0)
    model = torch.nn.LSTM(8, 8, batch_first=True)
    step = training_step(model, (torch.randn(4, 6, 8),), loss_fn=lambda out, x: out[0].sum())
    g = step.graph
    (layer,) = [v for v in g.ops() if g.node(v).op == "aten.mkldnn_rnn_layer.default"]
    assert g.meta(Ref(layer, 3)).nbytes == 0 and g.storages().nbytes[Ref(layer, 3)] > 0
    assert not swappable(g, Ref(layer, 3))
    assert swappable(g, Ref(layer, 0))
