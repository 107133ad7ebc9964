"""Hashes of what the two recipes make on a small slice: the check that a refactoring
changed nothing a user gets.

    python scripts/recipe_slice_hashes.py --out /tmp/slices > before.json
    ... change the code ...
    python scripts/recipe_slice_hashes.py --out /tmp/slices2 > after.json
    diff before.json after.json

Runs `configs/multi30k-en-de.toml` and `configs/ptb-sample-parse.toml` shrunk to seconds
(the same stages, a toy model, as tests/experiments/test_recipe.py and test_parse_recipe.py
shrink them, with length-penalty tuning and the beam/alpha grid on) on the shared data, and
prints, per recipe: the sha256 of every checkpoint's weights and optimizer state (the tensors'
bytes in key order: a checkpoint's file also holds wall times), of every output file the run
wrote (hypotheses, trees, tuning outputs), and the scores in results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # --shared: another checkout's data

COMMON = [
    "recipe.vocab_size=300",
    "N=1",
    "d_model=32",
    "d_ff=64",
    "h=2",
    "d_k=16",
    "d_v=16",
    "dtype=fp32",
    "warmup_steps=4",
    "log_interval_steps=2",
]
SLICES: dict[str, tuple[Path, Path, list[str]]] = {
    "translate": (
        ROOT / "configs" / "multi30k-en-de.toml",
        Path("data") / "multi30k",
        [
            "recipe.max_train_pairs=300",
            "recipe.max_test_pairs=12",
            "recipe.average_last=3",
            "recipe.tune_alpha=0.6,1.0",
            "max_steps=12",
            "save_interval_steps=3",
            "valid_interval_steps=6",
            "train.max_tokens=600",
        ],
    ),
    "parse": (
        ROOT / "configs" / "ptb-sample-parse.toml",
        Path("data") / "ptb-sample" / "treebank.zip",
        [
            "recipe.max_train_pairs=200",
            "recipe.max_test_pairs=10",
            "recipe.average_last=2",
            "recipe.tune_beam=1,2",
            "recipe.tune_alpha=0.3,1.0",
            "recipe.evalb=",
            "max_steps=8",
            "save_interval_steps=4",
            "valid_interval_steps=8",
            "train.max_tokens=1500",
            "decode.max_len_a=2",
            "decode.max_len_b=10",
        ],
    ),
}
OUTPUTS = (".hyp", ".trees", ".lin")


def tensor_hash(obj: Any, h: Any) -> None:
    """Feed every tensor under `obj` (dicts in key order) into the hash `h`."""
    import torch

    if isinstance(obj, torch.Tensor):
        h.update(str((obj.dtype, tuple(obj.shape))).encode())
        h.update(obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            tensor_hash(obj[k], h)
    elif isinstance(obj, list | tuple):
        for x in obj:
            tensor_hash(x, h)


def run_hashes(run: Path) -> dict[str, Any]:
    """The run's checkpoints' tensors, output files and scores."""
    import torch

    out: dict[str, Any] = {"checkpoints": {}, "outputs": {}}
    for path in sorted(run.glob("checkpoint_*.pt")):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        h = hashlib.sha256()
        tensor_hash({k: ckpt.get(k) for k in ("model", "optimizer")}, h)
        out["checkpoints"][path.name] = h.hexdigest()[:16]
    for path in sorted(p for p in run.rglob("*") if p.is_file() and p.suffix in OUTPUTS):
        out["outputs"][str(path.relative_to(run))] = hashlib.sha256(path.read_bytes()).hexdigest()[
            :16
        ]
    results = json.loads((run / "results.json").read_text(encoding="utf-8"))
    out["scores"] = results["scores"]
    out["decode"] = results["config"]["decode"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a directory for the two runs (replaced)")
    p.add_argument("--only", choices=sorted(SLICES), help="run one recipe's slice (default: both)")
    p.add_argument(
        "--shared",
        type=Path,
        default=SHARED,
        help="the folder holding data/multi30k and data/ptb-sample (default: ../shared)",
    )
    args = p.parse_args()
    import shutil

    from aiayn.cli import main as aiayn

    report = {}
    for name, (config, data, sets) in SLICES.items():
        if args.only and name != args.only:
            continue
        run = Path(args.out) / name
        shutil.rmtree(run, ignore_errors=True)
        argv = ["recipe", str(config), "--data", str(args.shared / data), "--out", str(run)]
        argv.append("--no-progress")
        for s in COMMON + sets:
            argv += ["--set", s]
        with contextlib.redirect_stdout(sys.stderr):  # the recipe's summary: not the report
            code = aiayn(argv)
        if code not in (0, 3):  # 3: done, the toy model flagged as not trained enough
            print(f"{name}: aiayn recipe exited {code}", file=sys.stderr)
            return 1
        report[name] = run_hashes(run)
    print(json.dumps(report, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
