"""Is int8 right on every instruction set? The int8 product engines, held to each ISA.

    python benchmarks/int8_by_isa.py                              # the products alone
    python benchmarks/int8_by_isa.py --checkpoint RUN/checkpoint_avg.pt \
        --src data/test.en --ref data/test.de --lang de           # and whole translations

For each instruction-set ceiling this CPU can be held to (AVX-512 with VNNI, AVX-512 without
it, AVX2), in a fresh process each:
- torch._int_mm (oneDNN's s8s8s32 GEMM, what PyTorch's int8 runs on) and aiayn's int8
  product (`int8_ops.int8_matmul`) against the exact integer product on operands of the
  whole range [-127, 127]: the fraction of wrong results and the largest error;
- with --checkpoint: the checkpoint exported to CTranslate2 with int8 weights, and
  `aiayn translate --dtype int8`, translating --src, each scored against --ref (sacreBLEU).

The same exported files under each ceiling tell the engine's arithmetic from the export's:
if one directory translates well held to AVX-512 and badly held to AVX2, the fault is in
the engine's int8 kernels for that ISA, not in the export.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, ONEDNN_MAX_CPU_ISA, CT2_FORCE_CPU_ISA, AIAYN_CPU_ISA)
CEILINGS = [
    ("avx512-vnni", "AVX512_CORE_VNNI", "AVX512", ""),
    ("avx512-no-vnni", "AVX512_CORE", "AVX512", "avx512"),
    ("avx2", "AVX2", "AVX2", "avx2"),
]

PRODUCTS = """
import json, torch
from aiayn.fast import int8_ops
g = torch.Generator().manual_seed(0)
a = torch.randint(-127, 128, (64, 512), dtype=torch.int8, generator=g)
b = torch.randint(-127, 128, (96, 512), dtype=torch.int8, generator=g)
exact = a.long() @ b.long().t()
out = {"int8_backend": int8_ops.backend()}
for name, got in (("torch._int_mm", torch._int_mm(a, b.t())),
                  ("aiayn int8_matmul", int8_ops.int8_matmul(a, b))):
    err = (got.long() - exact).abs()
    out[name] = {"wrong": float((err > 0).float().mean()), "max_error": int(err.max())}
print(json.dumps(out))
"""

CT2 = """
import json, sys, ctranslate2, sentencepiece as spm
out, src = sys.argv[1], sys.argv[2]
sp = spm.SentencePieceProcessor(model_file=out + "/sentencepiece.model")
lines = open(src, encoding="utf-8").read().splitlines()
t = ctranslate2.Translator(out, compute_type="int8")
res = t.translate_batch([sp.encode(x, out_type=str) for x in lines], beam_size=4,
                        max_batch_size=64)
print(json.dumps([sp.decode(r.hypotheses[0]) for r in res]))
"""


def run(code: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(
        code, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return done.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="an aiayn checkpoint to export and translate with")
    p.add_argument("--src", help="source sentences, one a line (with --checkpoint)")
    p.add_argument("--ref", help="their references (with --checkpoint)")
    p.add_argument("--lang", default="de", help="the target language, for sacreBLEU")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    from aiayn.cpu_isa import cpu

    c = cpu()
    print(f"# {c.model}, class {c.cls}", flush=True)
    results: dict[str, dict] = {}
    tmp = Path(tempfile.mkdtemp(prefix="int8-by-isa-"))
    if args.checkpoint:
        from aiayn.deploy.export import export_ctranslate2

        export_ctranslate2(Path(args.checkpoint), tmp / "ct2-int8", "int8")
    for name, onednn, ct2, ours in CEILINGS:
        if c.detected in ("avx2", "portable") and name.startswith("avx512"):
            continue  # this CPU cannot run AVX-512
        env = {"ONEDNN_MAX_CPU_ISA": onednn, "CT2_FORCE_CPU_ISA": ct2, "AIAYN_CPU_ISA": ours}
        if not ours:
            del env["AIAYN_CPU_ISA"]
        row = json.loads(run([sys.executable, "-c", PRODUCTS], env).strip().splitlines()[-1])
        if args.checkpoint:
            from aiayn.scoring.bleu import score_files

            hyps = json.loads(
                run([sys.executable, "-c", CT2, str(tmp / "ct2-int8"), args.src], env)
            )
            ct2_hyp = tmp / f"ct2.{name}.hyp"
            ct2_hyp.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
            aiayn_hyp = tmp / f"aiayn.{name}.hyp"
            run(
                [
                    sys.executable,
                    "-m",
                    "aiayn",
                    "translate",
                    "--checkpoint",
                    args.checkpoint,
                    "--input",
                    args.src,
                    "--output",
                    str(aiayn_hyp),
                    "--dtype",
                    "int8",
                    "--no-progress",
                ],  # fmt: skip
                env,
            )
            row["ctranslate2 int8 sacreBLEU"] = score_files(
                ct2_hyp, Path(args.ref), args.lang
            ).sacrebleu
            row["aiayn int8 sacreBLEU"] = score_files(
                aiayn_hyp, Path(args.ref), args.lang
            ).sacrebleu
            row["ctranslate2 first line"] = hyps[0]
        results[name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
