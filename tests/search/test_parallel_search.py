"""Children evaluated by parallel workers (issue #18): for a seed and `max_states`, two workers
record the same states in the same order as one, so the plan is the same."""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import pytest

from magis.capture import workload_step
from magis.cost import get_cost_model
from magis.search import Mode, Objective, SearchOptions, optimize_graph
from magis.sim import simulate

MAX_STATES = 40


@functools.cache
def _graph(workload: str):
    _, step = workload_step(workload, float64_when_tiny=True)
    return step.graph


def _search(workload: str, mode: Mode, ratio: float, **options):
    graph, cost = _graph(workload), get_cost_model("rtx3090")
    base = simulate(graph, graph.program_order(), cost)
    limit = ratio * base.latency_s if mode is Mode.LATENCY_LIMIT else int(ratio * base.peak_bytes)
    opts = SearchOptions(time_budget=600, max_states=MAX_STATES, seed=0, **options)
    return optimize_graph(graph, cost, Objective(mode, limit), opts)


def _trace(result):
    """Everything the serial order decides: the improvements in order, the best plan, and
    what was counted on the way."""
    s = result.stats
    return (
        [(i.memory, i.latency, i.rule) for i in result.improvements],
        result.best.hash.value,
        result.best.history,
        result.best.order,
        s.states_explored,
        dict(s.rules_applied),
        s.duplicates,
        s.meta_rejected,
    )


@pytest.mark.parametrize(
    "workload, mode, ratio",
    [("bert-base:tiny", Mode.LATENCY_LIMIT, 1.10), ("resnet50:tiny", Mode.MEMORY_LIMIT, 0.6)],
)
def test_two_workers_record_what_one_records(workload, mode, ratio):
    serial = _search(workload, mode, ratio)
    parallel = _search(workload, mode, ratio, workers=2)
    assert serial.stats.states_explored == MAX_STATES
    assert len(serial.improvements) > 1  # the search found something to compare
    assert _trace(parallel) == _trace(serial)


def test_ray_actors_record_what_one_worker_records():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'magis[ray]')")
    serial = _search("bert-base:tiny", Mode.MEMORY_LIMIT, 0.7)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = _search("bert-base:tiny", Mode.MEMORY_LIMIT, 0.7, workers=2, ray="local")
    finally:
        ray.shutdown()
    assert _trace(on_ray) == _trace(serial)


def test_a_worker_reanalyses_the_state_it_holds_as_the_main_process_would():
    """The re-analysis of a popped best state runs in its worker (`ChildWorker.reanalyse`):
    the same F-Tree as `Reanalysis.lineage` builds in the serial search, at the epoch the
    main process hands it."""
    from magis.search import initial_state
    from magis.search.fission_moves import Reanalysis, hotspot_key
    from magis.search.messages import HotspotKey, Reanalyse, Task
    from magis.search.pickling import dumps
    from magis.search.workers import ChildWorker

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    options = SearchOptions(time_budget=600, max_states=MAX_STATES)
    objective = Objective(Mode.LATENCY_LIMIT, 1.1 * state.latency)
    worker = ChildWorker(0, dumps((cost, options, (), objective)))
    worker.handle(Task((-1, 1), 0, dumps(state), (), (), ()))  # it now holds the state
    assert worker.handle(HotspotKey((-1, 1))) == hotspot_key(state.sim.hotspots)

    found, seconds = worker.handle(Reanalyse((-1, 1), 4, 7))
    serial = Reanalysis(4, 0.0).lineage(
        state.graph, state.order, state.sim.hotspots, state.frozen, elapsed=1e9
    )
    assert found and seconds > 0 and serial is not None
    lineage = worker.states[(-1, 1)].fission
    assert lineage.epoch == 7 and lineage.base_order == serial.base_order
    assert len(lineage.tree) == len(serial.tree)


def test_a_state_travels_with_the_searchs_cost_model_by_name_and_keeps_its_node_times():
    """Between processes a state names the search's cost model instead of copying it: the
    receiver's own model takes its place, so the node times cached for it on the graph are
    found there (with a copy, and its op-time memo, a worker re-timed the whole graph of every
    state it was sent)."""
    import pickle

    from magis.search import initial_state
    from magis.search.pickling import dumps, loads
    from magis.sim.tables import _TIMES, node_times

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    times = node_times(state.graph, cost)
    mine = get_cost_model("rtx3090")  # the receiving process's model of the same search
    got = loads(dumps(state, cost=cost), mine)
    cached = got.graph.derived(_TIMES, dict)
    assert mine in cached and (cached[mine] == times).all()
    assert node_times(got.graph, mine) is cached[mine]
    copied = loads(dumps(state), mine)  # sent by value: the copy is cached, not the receiver's
    assert mine not in copied.graph.derived(_TIMES, dict)
    with pytest.raises(pickle.UnpicklingError, match="cost model"):
        loads(dumps(state, cost=cost))


def test_what_compares_by_identity_arrives_as_the_receivers_own():
    """The op registry, the rules and the keys of a graph's cached facts travel by name: the
    received graph finds its facts under the receiver's keys (a copied key orphans them), and
    a sentinel that is not declared at module level cannot be sent at all."""
    import pickle

    from magis.ir import DEFAULT_REGISTRY
    from magis.search import initial_state
    from magis.search.optimizer import default_rules
    from magis.search.pickling import dumps, loads
    from magis.sim.tables import _TABLES

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    rules = default_rules()
    got, got_rules, registry = loads(dumps((state, rules, DEFAULT_REGISTRY)))
    assert registry is DEFAULT_REGISTRY and all(
        a is b for a, b in zip(got_rules, rules, strict=True)
    )
    assert _TABLES in got.graph._derived  # found by the receiver's own key
    with pytest.raises(pickle.PicklingError, match="sentinel"):
        dumps({"mark": object()})


def _booted(workers, seconds: float = 120.0):
    deadline = time.monotonic() + seconds
    while not workers.booted():
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    return workers


def test_under_a_time_budget_each_worker_expands_states_of_its_own():
    """Without `max_states`, workers expand popped states concurrently
    (`magis.search.concurrent`): the search records states, fetches its best from the worker
    that built it, and that best is a valid schedule of a graph that passes the meta check.
    The workers are up before the budget starts (on a loaded machine their start alone took
    the whole budget), so the budget is theirs."""
    from magis.backend.meta_check import check_graph
    from magis.search import start_search_workers

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    base = simulate(graph, graph.program_order(), cost)
    objective = Objective(Mode.LATENCY_LIMIT, 1.10 * base.latency_s)
    options = SearchOptions(time_budget=8, workers=2)
    workers = _booted(start_search_workers(cost, options, objective))
    result = optimize_graph(graph, cost, objective, options, workers=workers)
    assert result.stats.states_explored > 10
    assert result.best.memory < base.peak_bytes  # it improved on the program order
    assert result.best.graph.is_valid_schedule(list(result.best.order))
    check_graph(result.best.graph)
    assert simulate(result.best.graph, result.best.order, cost).peak_bytes == result.best.memory


def test_the_best_is_reordered_in_its_worker_while_the_search_goes_on(monkeypatch):
    """Once only the final re-ordering's reserve is left, the worker holding the best
    re-orders it and the search goes on recording states until the budget's end (the
    re-ordering is made to look costly, so that its reserve is a quarter of the budget). What
    the worker returns is what the main process makes of that state: the better of the state
    and its re-ordering, simulated in detail; the plan is the better of it and any later best."""
    from magis.search import pool as pool_module
    from magis.search import start_search_workers
    from magis.search.budget import PolishCost
    from magis.search.evaluator import Evaluator
    from magis.search.messages import FetchState
    from magis.search.pickling import loads

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    base = simulate(graph, graph.program_order(), cost)
    objective = Objective(Mode.LATENCY_LIMIT, 1.10 * base.latency_s)
    options = SearchOptions(time_budget=8, workers=2)
    monkeypatch.setattr(PolishCost, "estimate", lambda self, nodes: 2.0)
    asked = []  # (pool, the state re-ordered, states recorded when it was asked for)
    answers = []
    children = pool_module.ParallelChildren
    reorder, reordered = children.reorder, children.reordered

    def asking(pool, sid, wid):
        assert wid in pool.states.holders(sid)
        state = loads(pool.call_holder(sid, FetchState(sid)), cost)
        asked.append((pool, state, len(pool.seen_log)))
        return reorder(pool, sid, wid)

    def answering(pool):
        answers.append(reordered(pool))
        return answers[-1]

    monkeypatch.setattr(children, "reorder", asking)
    monkeypatch.setattr(children, "reordered", answering)
    workers = _booted(start_search_workers(cost, options, objective))
    result = optimize_graph(graph, cost, objective, options, workers=workers)
    [(pool, state, recorded)], [(final, won, _)] = asked, answers
    assert len(pool.seen_log) > recorded  # states recorded while it was re-ordered, and after
    assert result.stats.breakdown["polish_in_worker"] > 0
    here, won_here = Evaluator(cost).reordered(state, objective, True)
    assert (final.order, final.memory, final.latency, won) == (
        here.order, here.memory, here.latency, won_here,
    )  # fmt: skip
    assert final.sim.breakdown == here.sim.breakdown != {}  # with the detail
    assert not objective.better(final, result.best)
    assert result.best.graph.is_valid_schedule(list(result.best.order))
    assert simulate(result.best.graph, result.best.order, cost).peak_bytes == result.best.memory


def test_the_first_worker_builds_the_initial_state_the_main_process_would(monkeypatch):
    """Started with the step's graph, the first worker builds the initial state while the
    main process does other work (the warm starts): the same schedule, simulation, hash and
    F-Tree as the main process builds. A search on those workers starts from the state that
    worker holds: its first pop goes to that worker, without the state's bytes."""
    from magis.search import pool as pool_module
    from magis.search import start_search_workers
    from magis.search.initial import INITIAL_SID, search_start

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    base = simulate(graph, graph.program_order(), cost)
    objective = Objective(Mode.LATENCY_LIMIT, 1.10 * base.latency_s)
    options = SearchOptions(time_budget=8, workers=2)
    workers = start_search_workers(cost, options, objective, graph)
    try:
        built = workers.take_initial(cost).state
        assert workers.take_initial(cost) is None  # one answer, taken once
    finally:
        workers.close()
    here = search_start(graph, cost, options).state
    assert (built.order, built.hash.value) == (here.order, here.hash.value)
    assert (built.memory, built.latency) == (here.memory, here.latency)
    assert [(x.ftrans, x.enabled) for x in built.fission.tree.nodes] == [
        (x.ftrans, x.enabled) for x in here.fission.tree.nodes
    ]

    submitted = []  # (state, whether the worker it went to held it)
    submit = pool_module.ParallelChildren.submit

    def recording(pool, wid, moves, index, batch=None):
        submitted.append((moves.sid, wid in pool.states.holders(moves.sid)))
        return submit(pool, wid, moves, index, batch)

    monkeypatch.setattr(pool_module.ParallelChildren, "submit", recording)
    workers = start_search_workers(cost, options, objective, graph)
    result = optimize_graph(graph, cost, objective, options, workers=workers)
    assert result.stats.states_explored > 10
    assert result.initial.hash.value == here.hash.value
    assert submitted[0] == (INITIAL_SID, True)  # the first pop went where the state was


def test_a_rewrite_that_raises_is_dropped_counted_and_warned_about(monkeypatch):
    """One broken child must not end a user's search (`Evaluator.failed`): the child is
    skipped, counted per rule, and a MagisWarning names the rule and the error."""
    from magis.errors import MagisWarning
    from magis.rules import RuleContext
    from magis.search import Evaluator, initial_state
    from magis.search.optimizer import default_rules

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    evaluator = Evaluator(cost, SearchOptions().memory_figure)
    ctx = RuleContext(state.graph, state.order, state.sim, state.frozen, True)
    name, make_child = next(evaluator.moves(state, default_rules(), ctx))
    monkeypatch.setattr("magis.search.evaluator.reschedule", lambda *a: {}[1940])
    with pytest.warns(MagisWarning, match=f"a {name} child could not be built"):
        assert make_child() is None
    assert evaluator.stats.failed_children[name] == 1


def test_a_rule_that_raises_while_it_matches_offers_no_more_and_the_others_go_on():
    """A rule's match that raises (split_conv_backward on EfficientNet-B0's one-entry padding
    once did, in a worker, and ended both searches on it) ends that rule's moves on the
    state only: counted, warned about, and the other rules' moves still come."""
    from magis.errors import MagisWarning
    from magis.rules import REMAT, Rule, RuleContext, RuleKind
    from magis.search import Evaluator, initial_state

    def broken(ctx):
        yield replace(next(REMAT.match(ctx)), rule="broken")
        raise ValueError("zip() argument 5 is shorter than arguments 1-4")

    graph, cost = _graph("bert-base:tiny"), get_cost_model("rtx3090")
    state = initial_state(graph, cost, fission=False)
    evaluator = Evaluator(cost, SearchOptions().memory_figure)
    ctx = RuleContext(state.graph, state.order, state.sim, state.frozen, True)
    rules = (Rule("broken", RuleKind.REMAT, broken), REMAT)
    with pytest.warns(MagisWarning, match="a broken child could not be built"):
        names = [name for name, _ in evaluator.moves(state, rules, ctx)]
    assert len(names) == 1 + len(list(REMAT.match(ctx)))  # its one, then all of REMAT's
    assert evaluator.stats.failed_children["broken"] == 1


UNGUARDED = (
    "import magis\n"
    "from magis.capture import workload_step\n"
    'print("TOP-LEVEL MARKER", flush=True)\n'
    '_, step = workload_step("bert-base:tiny", float64_when_tiny=True)\n'
    "magis.optimize(step, lat_limit=1.1, max_states=5, workers=2)\n"
    'print("SEARCH ENDED", flush=True)\n'
)


def _run_script(tmp_path, text: str):
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_an_unguarded_script_with_workers_is_refused_before_any_worker_runs_it(tmp_path):
    """A worker runs the caller's script again as it starts (forkserver, spawn: the standard
    library's preparation of `__main__`): a script without a `__main__` guard repeated its
    whole top level in every worker, capture, searches and prints, and both processes could
    wait for ever. Now the search refuses before any worker starts, in one line that says
    where and what to do: the script's top level ran once."""
    run = _run_script(tmp_path, UNGUARDED)
    assert run.returncode != 0
    assert run.stdout.count("TOP-LEVEL MARKER") == 1, run.stdout
    assert "SEARCH ENDED" not in run.stdout
    error = [line for line in run.stderr.splitlines() if "UnguardedMainError: " in line]
    assert len(error) == 1, run.stderr
    assert "line 5 of the script" in error[0] and 'if __name__ == "__main__":' in error[0]
    assert "WorkerError" not in run.stderr


def test_a_guarded_script_is_not_refused(tmp_path):
    """The check reads the running statement of the script: under the guard it passes (and
    so does code the workers would not run again: `python -c`, an interactive session)."""
    from magis.search.main_guard import unguarded_main_line

    guarded = (
        "from magis.search.main_guard import unguarded_main_line\n"
        "print('top', unguarded_main_line())\n"
        "if __name__ == '__main__':\n"
        "    print('guarded', unguarded_main_line())\n"
    )
    run = _run_script(tmp_path, guarded)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["top 2", "guarded None"]
    assert unguarded_main_line() is None  # pytest's own __main__ is guarded or not re-run
