"""The commands of magis, one module each; the CLI (`magis.cli`) and Python callers both call
these functions, and each returns a dataclass whose `to_json()` is what `--json PATH` writes
(bytes in bytes, times in seconds).

- `analyze`: a step simulated in program order, and its F-Tree (MAGIS §4.3);
- `run`: a step, a saved plan, or a step with F-Tree nodes enabled, executed as generated code,
  verified against eager PyTorch and measured (MAGIS §7.1);
- `schedule`: one scheduler against the program order (MAGIS §5.2, §6.1);
- `layout`: one arena for every tensor, and the step run inside it (ROAM §IV-B);
- `optimize`: the search (MAGIS §6.2) from a step or a model to a `magis.plan.Plan`;
- `demo`, `workloads`.

`shared` holds what they have in common: the cost model prepared for a graph and the one
verify-and-measure sequence. Import the module of the command you call (`from
magis.commands.run import run`): each pulls in only the packages it needs.
"""
