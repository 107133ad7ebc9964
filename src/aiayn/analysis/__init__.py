"""What the paper argues with besides BLEU, measured and drawn.

- Table 1 (section 4, "Why Self-Attention"): `table1` measures the layers of `layers`
  (time, FLOPs and memory per layer with `measure`; sequential operations and maximum
  path lengths from the computation itself with `paths`) and `table1_text` prints the
  paper's table with the measurements beside its formulas.
- Figures 3-5 (attention heads): `attention` records every head's weights for a sentence
  and the model's own translation of it.

`plots` draws both; matplotlib is imported inside its functions only (the `plot` extra).
Importing this package turns the speed paths on (`aiayn.fast`, through `aiayn.speed`).
"""

import aiayn.fast  # noqa: F401  # the speed paths on, for whoever measures through here
