"""Speed paths: everything in aiayn that exists to be fast rather than to be the paper.

The paper's code runs without any of it. Importing this package turns the speed paths on:
it registers its implementations with the one seam, `aiayn.speed` (`registry.register`),
through which the paper's code asks for them; `accelerate(model)` swaps the model's
modules for their fast subclasses (see `aiayn.fast.layers`). The layers that build a run
(cli, experiments, analysis, deploy) import it.
"""

from aiayn.fast.layers import accelerate, is_accelerated
from aiayn.fast.registry import register

register()

__all__ = ["accelerate", "is_accelerated"]
