"""Experiments built from the stages: the one-command recipes, benchmarks and curves.

The experiments build the runs, so importing this package turns the speed paths on
(`aiayn.fast` registers them with the seam, `aiayn.speed`); the paper's code below runs
without them."""

import aiayn.fast  # noqa: F401  # the speed paths on (aiayn.speed)
