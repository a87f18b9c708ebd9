"""How a search's popped states are expanded: the strategies over `magis.search.core`.

A strategy drives the loop of Alg. 3 through the core's public interface (`pop`, `expand` or
`record`, `push`, `finish`) and answers for the states it keeps elsewhere. Three exist:

- `SerialStrategy` (here): every child built in this process, one after the other;
- `magis.search.parallel.ParallelStrategy`: a popped state's children built by worker
  processes or Ray actors, recorded in the serial order (a search bounded by `max_states`: the
  same plan as serial);
- `magis.search.concurrent.ConcurrentStrategy`: each worker expands a popped state of its own
  (a search bounded by time).

`strategy_for` picks one from the options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from magis.search.concurrent import ConcurrentStrategy
from magis.search.core import ReorderedBest, SearchCore
from magis.search.initial import SearchStart
from magis.search.parallel import ParallelStrategy
from magis.search.state import MState

if TYPE_CHECKING:
    from magis.cost import CostModel
    from magis.search.messages import Summary
    from magis.search.options import SearchOptions
    from magis.search.transport import SearchWorkers


class SearchStrategy(Protocol):
    """One way to run the search loop over a `SearchCore`."""

    def initial_start(self, cost: CostModel) -> SearchStart | None:
        """The initial state, when the strategy built it elsewhere (a worker), else None."""
        ...

    def run(self, core: SearchCore) -> None:
        """Pop and expand until the budget is spent or nothing is left to expand."""
        ...

    def whole(self, core: SearchCore, state: MState | Summary) -> MState:
        """The state itself, wherever it lives."""
        ...

    def reordered_best(self, core: SearchCore) -> ReorderedBest | None:
        """The final re-ordering of the best made elsewhere, if one was."""
        ...

    def close(self) -> None:
        """Release what the strategy started (worker processes)."""
        ...


class SerialStrategy:
    """Every child built and recorded in this process (`SearchCore.expand`)."""

    def initial_start(self, cost: CostModel) -> SearchStart | None:
        return None

    def run(self, core: SearchCore) -> None:
        while core.queue and not core.out_of_budget():
            core.expand(*core.pop())

    def whole(self, core: SearchCore, state: MState) -> MState:
        return state

    def reordered_best(self, core: SearchCore) -> ReorderedBest | None:
        return None

    def close(self) -> None:
        pass


def strategy_for(options: SearchOptions, workers: SearchWorkers | None) -> SearchStrategy:
    """The strategy of a search with these options: serial with one worker; with more, the
    serial order kept when the search is bounded by `max_states` (reproducible), else each
    worker expanding states of its own. `workers`: the started workers of `options.workers`
    > 1 (`magis.search.parallel.start_workers`)."""
    if workers is None:
        return SerialStrategy()
    if options.workers <= 1:  # started for another search: not needed by this one
        workers.close()
        return SerialStrategy()
    if options.max_states is None:
        return ConcurrentStrategy(workers)
    return ParallelStrategy(workers)
