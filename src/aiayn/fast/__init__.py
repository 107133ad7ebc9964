"""Speed paths: everything in aiayn that exists to be fast rather than to be the paper.

The paper's model (`aiayn.model`) runs without any of it; `accelerate(model)` is the one
seam through which these paths plug in (see `aiayn.fast.layers`).
"""

from aiayn.fast.layers import accelerate, is_accelerated

__all__ = ["accelerate", "is_accelerated"]
