"""Summarise benchmarks/gpu_parse.sh's runs: RUNS_DIR OUT.json (one record per run)."""

import json
import sys
from pathlib import Path

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
records = []
for d in sorted(p for p in runs.iterdir() if p.is_dir()):
    rec = {"run": d.name}
    r = d / "results.json"
    if r.is_file():
        res = json.loads(r.read_text())
        rec["train"] = res["train"]
        rec["decode"] = {k: res["config"]["decode"][k] for k in ("beam", "alpha")}
        rec["tuning"] = res.get("tuning")
        rec["scores"] = {
            k: {
                "aiayn_f1": v["aiayn"]["f1"],
                "evalb_f1": v.get("evalb", {}).get("f1"),
                "evalb_error": v.get("evalb_error"),
                "reports_equal": v.get("reports_equal"),
            }
            for k, v in res["scores"].items()
        }
        p = res["parse"]
        rec["parse"] = {
            "constrained_sents_per_s": p["sentences_per_s"],
            "constrained_ill_formed": p["ill_formed"],
            "unconstrained_sents_per_s": p["unconstrained"]["sentences_per_s"],
            "unconstrained_ill_formed": p["unconstrained"]["ill_formed"],
            "tree_limits": p.get("tree_limits"),
        }
        rec["wall"] = res.get("wall_seconds")
    c = d / "curve.json"
    if c.is_file():
        cur = json.loads(c.read_text())
        rec["curve"] = [(x["step"], round(x["dev_f1"], 2)) for x in cur["curve"]]
        rec["selected"] = cur.get("selected")
    records.append(rec)
out.write_text(json.dumps(records, indent=1) + "\n")
for rec in records:
    s = rec.get("scores", {})
    print(
        rec["run"],
        rec.get("train", {}).get("steps"),
        "constrained",
        s.get("model", {}).get("aiayn_f1"),
        "free",
        s.get("model_unconstrained", {}).get("aiayn_f1"),
        "selected",
        (rec.get("selected") or {}).get("test_f1"),
    )
