"""Dev F1 against training steps for a parsing recipe's run, and the checkpoint it selects.

Each checkpoint a run kept (`checkpoint_STEP.pt`; keep them with `--set train.keep_last=N`)
parses the development set under the tree constraint (beam `--beam`), scored by aiayn's
EVALB (COLLINS.prm, no error limit); the checkpoint with the best dev F1 then parses the
test set at the recipe's chosen beam and alpha, constrained: section 6.3's model chosen
by dev F1 instead of by averaging the last five.

    python scripts/parse_curve.py RUN [--beam 4] [--device cuda] [--json OUT.json]

Prints one JSON object: {"curve": [{"step", "dev_f1"}...], "selected": {...}}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a parsing recipe's run directory")
    ap.add_argument("--beam", type=int, default=4, help="beam for the dev curve (default 4)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, ...")
    ap.add_argument("--every", type=int, default=1, help="use every N-th checkpoint")
    ap.add_argument("--json", type=Path, help="also write the object here")
    args = ap.parse_args(argv)

    from aiayn.checkpoints import load_ensemble
    from aiayn.decoding.parse import parse_file
    from aiayn.decoding.tree_constraint import tree_limits
    from aiayn.files import read_lines
    from aiayn.scoring.evalb import COLLINS, score_files

    run = args.run
    results = json.loads((run / "results.json").read_text())
    recipe = results["recipe"]
    lin = recipe.get("linearization", "words")
    data = run / "data"
    target = {"words": "linw", "gafl": "lin"}[lin]
    train_target = next(
        iter(sorted(data.glob(f"train*.{target}"))), data / "ptb" / f"train.{target}"
    )
    limits = tree_limits(list(read_lines(train_target)))
    dev = data / "ptb" / "dev"
    test = data / "ptb" / "test"
    if recipe.get("max_test_pairs"):
        n = recipe["max_test_pairs"]
        dev, test = data / f"dev.first{n}", data / f"test.first{n}"
    params = replace(COLLINS, max_error=10**9)
    found = []
    for p in run.glob("checkpoint_*.pt"):
        m = re.fullmatch(r"checkpoint_(\d+)\.pt", p.name)
        if m:
            found.append((int(m.group(1)), p))
    found.sort()
    found = found[:: args.every] if args.every > 1 else found
    curve = []
    work = run / "curve"
    work.mkdir(exist_ok=True)
    for step, path in found:
        models, tokenizer, cfg = load_ensemble([path], device=args.device)
        model = models[0].eval()
        dcfg = replace(cfg.decode, beam=args.beam, nbest=1)
        t0 = time.perf_counter()
        hyp = work / f"dev.{step}.trees"
        parse_file(
            model,
            tokenizer,
            Path(f"{dev}.words"),
            hyp,
            dcfg,
            args.device,
            limits=limits,
            linearization=lin,
        )
        f1 = score_files(Path(f"{dev}.trees"), hyp, params).all.f1
        curve.append({"step": step, "dev_f1": f1, "seconds": time.perf_counter() - t0})
        print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
    out: dict = {"run": str(run), "beam": args.beam, "tree_limits": vars(limits), "curve": curve}
    if curve:
        best = max(curve, key=lambda r: r["dev_f1"])
        path = run / f"checkpoint_{best['step']}.pt"
        models, tokenizer, cfg = load_ensemble([path], device=args.device)
        chosen = results["config"]["decode"]
        dcfg = replace(cfg.decode, beam=chosen["beam"], alpha=chosen["alpha"], nbest=1)
        hyp = work / "test.selected.trees"
        _, summary = parse_file(
            models[0].eval(),
            tokenizer,
            Path(f"{test}.words"),
            hyp,
            dcfg,
            args.device,
            limits=limits,
            linearization=lin,
        )
        s = score_files(Path(f"{test}.trees"), hyp, params).all
        out["selected"] = {
            "step": best["step"],
            "dev_f1": best["dev_f1"],
            "test_f1": s.f1,
            "test_precision": s.precision,
            "test_recall": s.recall,
            "beam": chosen["beam"],
            "sentences_per_s": summary["sentences_per_s"],
        }
    text = json.dumps(out)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
