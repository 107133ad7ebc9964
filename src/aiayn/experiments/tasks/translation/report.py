"""Translation's results for the terminal: every score with its signature."""

from __future__ import annotations

from typing import Any


def format_results(results: dict[str, Any]) -> str:
    """Every BLEU convention side by side, with signatures, for the terminal."""
    s = results["scores"]
    t = results["train"]
    f = results["flops"]
    k = results.get("ensemble", 1)
    models = (
        f"an ensemble of {k} models, each the average of {len(results['averaged'])} "
        f"checkpoints, {results['parameters']:,} params each"
        if k > 1
        else f"average of {len(results['averaged'])} checkpoints, {results['parameters']:,} params"
    )
    lines = [
        f"{results['pair']} {results['test_split']} ({s['n_lines']} sentences), {models}",
        f"  sacreBLEU         {s['sacrebleu']:6.2f}  {s['sacrebleu_signature']}",
        f"  tok-BLEU (lc)     {s['tok_bleu']:6.2f}  {s['tok_bleu_signature']}",
        f"  chrF2             {s['chrf']:6.2f}  {s['chrf_signature']}",
        *(
            [
                f"  paper             {s['paper_bleu']:6.2f}  {s['paper_bleu_signature']}",
                "                    (Table 2's convention: cased, Moses-tokenized"
                + (
                    ", compounds split at ##AT##)"
                    if "compound-split" in s["paper_bleu_signature"]
                    else ")"
                ),
            ]
            if "paper_bleu" in s
            else []
        ),
        f"  training: {t['steps']} steps, {t['epochs']} epochs, {t['train_seconds'] / 60:.1f} min,"
        f" {t['tokens'] / max(t['train_seconds'], 1e-9):,.0f} tokens/s ({t['stopped_by']})",
        f"  FLOPs: {f['counted_from_model']:.3g} counted, "
        f"{f['estimated_time_x_devices_x_peak']:.3g} as time x peak "
        f"({f['sustained_peak_flop_s'] / 1e12:.2f} TFLOP/s {f['peak_dtype']})",
    ]
    for m in t.get("members", []):
        ms = m["scores"]
        lines.append(
            f"  {m['run']} (seed {m['seed']}) alone: sacreBLEU {ms['sacrebleu']:.2f}, "
            f"tok-BLEU {ms['tok_bleu']:.2f}, chrF2 {ms['chrf']:.2f}; {m['steps']} steps"
        )
    tuning = results.get("alpha_tuning")
    if tuning and tuning.get("skipped"):
        sc = tuning["screen"]
        lines.insert(
            1,
            f"  beam {results['config']['decode']['beam']}, alpha {tuning['chosen']:g}: "
            f"tuning skipped, sacreBLEU {sc['sacrebleu']:.2f} on the first {sc['sentences']} "
            f"sentences of {tuning['split']}",
        )
    elif tuning:
        tried = ", ".join(f"{r['alpha']:g}: {r['sacrebleu']:.2f}" for r in tuning["tried"])
        lines.insert(
            1,
            f"  beam {results['config']['decode']['beam']}, alpha "
            f"{tuning['chosen']:g} chosen on {tuning['split']} "
            f"({tuning['sentences']} sentences; sacreBLEU by alpha {tried})",
        )
    if results.get("not_trained_enough"):
        lines.append(f"  WARNING: {results['not_trained_enough']['message']}")
    if results.get("recipe", {}).get("lowercase"):
        lines.insert(
            1,
            "  lowercased data (recipe.lowercase): every score is against the "
            "lowercased references",
        )
    return "\n".join(lines)
