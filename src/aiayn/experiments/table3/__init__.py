"""Table 3 of the paper, row by row, at a stated scale (`aiayn table3 FILE.toml --out DIR`).

The paper's Table 3 changes its base model one setting at a time (rows A-E) and reports
each variant's dev perplexity and BLEU (newstest2013). Here an experiment file names a
recipe whose model is the base row (e.g. configs/multi30k-en-de.toml), the settings that
size every row alike (`[sweep.set]`: steps, minutes, checkpoints: the budget per row), and
the rows as changes of that base (`[rows]`). Each row and seed trains in its own run
directory with the recipe's stages (`stages.train_stage`, `check_stopped`,
`average_stage`), then its averaged checkpoint is scored on the validation set:

    DIR/data/                    the corpus and its prepared form, made once for every row
    DIR/ROW/seedS/               one training run: checkpoints, train_log.jsonl, checkpoint_avg.pt
    DIR/ROW/seedS/dev.hyp        the validation set translated by the averaged model
    DIR/ROW/seedS/table3_row.json  the row's scores and the settings that made them; written
                                 last, so a run that has it is done
    DIR/table3.csv, table3.json  every finished row beside the paper's numbers

Scoring: dev PPL is the unsmoothed validation NLL per target subword of the averaged model
(`training.validation.validate`, as the trainer logs it for the raw model), exponentiated;
dev BLEU is sacreBLEU of the validation set decoded with the recipe's decode settings
(beam 4, alpha 0.6: the paper's; no alpha tuning, which would choose on the set scored)
or greedily (`dev_decode = "greedy"`); params counts the model's parameters (shared
embeddings once).

Resuming: a run that has table3_row.json made with the current training settings is not
trained again (only rescored, from its checkpoints, when the scoring settings changed);
one without it resumes from its last checkpoint, as `aiayn recipe` does. A finished (or
started) run whose training settings changed is refused before any work, naming the keys
and the directory; `rerun_changed` moves such directories aside (ROW/seedS.stale-K) and
trains them again.

Directions: each row's change of dev PPL and BLEU from its base row, against the paper's
change for the paper row it stands for. "same" when the two changes have one sign,
"opposite" when not, "tie" when either change rounds to zero at the paper's printed
precision (PPL 0.01, BLEU 0.1): the paper's rows equal to its base (A3's BLEU, E's PPL)
are ties whatever ours do. With several seeds a row's "within spread" says whether its
seeds' range (min-max) overlaps its base row's: a change inside the seed spread. Seeds on
one side are enough: a one-seed row is within the spread of a base row trained with
several when its value lies in their range (seeds for the base row alone measure the
spread at a third of the cost of seeds for every row).
"""

from __future__ import annotations

from aiayn.experiments.table3.files import (
    DERIVED,
    combine,
    read_csv,
    to_csv,
    to_json,
    write_outputs,
)
from aiayn.experiments.table3.grid import (
    RowSpec,
    Table3Experiment,
    load_table3,
    select_rows,
)
from aiayn.experiments.table3.paper import (
    PAPER_TABLE3,
    SETTINGS,
    TIE,
    PaperRow,
    moves,
    paper_analog,
    paper_settings,
    settings_of,
)
from aiayn.experiments.table3.probes import (
    import_probes,
    probe_settings,
)
from aiayn.experiments.table3.row import (
    ROW_FILE,
    read_run,
    score_key,
    score_run,
    train_key,
    train_key_diff,
)
from aiayn.experiments.table3.sweep import (
    aggregate,
    prepare_data,
    run_table3,
)
from aiayn.experiments.table3.table import (
    RunResult,
    Table3Report,
    TableRow,
    Verdict,
    cells,
    compare,
    direction,
    format_table,
    markdown,
    summary,
)

__all__ = [
    "DERIVED",
    "PAPER_TABLE3",
    "PaperRow",
    "ROW_FILE",
    "RowSpec",
    "RunResult",
    "SETTINGS",
    "TIE",
    "Table3Experiment",
    "Table3Report",
    "TableRow",
    "Verdict",
    "aggregate",
    "cells",
    "combine",
    "compare",
    "direction",
    "format_table",
    "import_probes",
    "load_table3",
    "markdown",
    "moves",
    "paper_analog",
    "paper_settings",
    "prepare_data",
    "probe_settings",
    "read_csv",
    "read_run",
    "run_table3",
    "score_key",
    "score_run",
    "select_rows",
    "settings_of",
    "summary",
    "to_csv",
    "to_json",
    "train_key",
    "train_key_diff",
    "write_outputs",
]
