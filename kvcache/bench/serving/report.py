"""The serving bench's table (``print_result``) and the targets it judges a full run by."""

from __future__ import annotations

from .rounds import runs_note
from .runners import SYSTEM_NAMES, SYSTEMS

TARGET_ROOFLINE = 1.3
"""(a)'s decode step at ``--batch`` over the roofline: at most this."""
TARGET_VS_B = 10.0
"""(a)'s tokens/s over (b)'s: at least this."""
TARGET_BUSY = 0.85
"""(a)'s GPU busy fraction during decode: at least this."""
TARGET_DET_STEP = 1.3
"""(d)'s decode step (deterministic) over (a)'s: at most this."""
TARGET_DET_TOKENS = 0.75
"""(d)'s tokens/s over (a)'s: at least this."""
TARGET_QUANT_TOKENS = 1.0
"""(a)'s tokens/s with quantized pages over (p)'s, 16-bit pages at the same batch: at least
this (quantized pages must not make the engine slower)."""

RATIO_LABELS = {"a_decode_step_over_roofline": "(a) decode step / roofline",
                "a_over_b_tokens_per_s": "(a) / (b) tokens/s",
                "a_gpu_busy": "(a) gpu busy during decode",
                "d_decode_step_over_a": "(d) decode step / (a)'s",
                "d_over_a_tokens_per_s": "(d) tokens/s / (a)'s",
                "a_over_p_tokens_per_s": "(a) tokens/s / (p)'s (quantized / 16-bit pages)",
                "a_decode_step_over_p": "(a) decode step / (p)'s"}
"""The result's ratios (``res["ratios"]``) in the report's words."""


def print_result(res: dict) -> None:
    w, roof = res["workload"], res["roofline"]
    print(f"kvcache bench --serving --model {w['model']}: {res['device']}, {res['date']}, "
          f"torch {res['torch']}, transformers {res['transformers']}")
    print(f"  workload: {w['requests']} requests, prompts {w['prompt_range'][0]}-"
          f"{w['prompt_range'][1]} tokens, {w['new_tokens']} new tokens each, {w['layers']} layers"
          f"{' (tiny dims)' if w['tiny'] else ' (Llama-3-8B layer shapes)'}, {w['dtype']}, "
          f"seed {w['seed']}")
    print(f"  decode step: B={w['batch']}, prompt {w['decode_prompt']}, (wall to "
          f"{w['decode_n2']} tokens - wall to {w['decode_n1']}) / {w['decode_n2'] - w['decode_n1']}"
          f"; gpu busy: kernel time / wall over the same steps (torch.profiler)")
    print(f"{'system':<48} {'tokens/s':>10} {'wall s':>8} {'decode step ms':>15} {'gpu busy':>9}")
    for key in SYSTEMS:
        r = res["systems"].get(key)
        if r is None:
            if key in res["skipped"]:
                print(f"({key}) {SYSTEM_NAMES[key]:<44} skipped: {res['skipped'][key]}")
            continue
        busy = "n/a" if r["gpu_busy"] is None else f"{r['gpu_busy'] * 100:.0f}%"
        step = r["decode_step_ms"]      # a difference of two walls: noise can make it negative
        step_text = f"{step:.3f}" if step > 0 else "<0 (noise)"
        print(f"({key}) {r['system']:<44} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} "
              f"{step_text:>15} {busy:>9}")
    print(f"(roofline) weights {roof['weight_bytes'] / 1e9:.3f} GB + KV "
          f"{roof['kv_bytes'] / 1e9:.3f} GB at {roof['copy_rate_Bps'] / 1e12:.3f} TB/s copy rate: "
          f"{roof['decode_step_ms']:>.3f} ms/step, {roof['tokens_per_s']:.0f} tokens/s at "
          f"B={w['batch']}")
    same = [f"({k}) {r['same_tokens_as_a']}/{w['requests']}" for k, r in res["systems"].items()
            if "same_tokens_as_a" in r]
    if same:
        print(f"requests whose greedy tokens equal (a)'s: {', '.join(same)}")
    note = runs_note(res)
    if note:
        print_runs(res, {f"({k})": r for k, r in res["systems"].items()},
                   (("tokens/s", "tokens_per_s", ".1f"), ("decode step ms", "decode_step_ms",
                                                          ".3f")),
                   RATIO_LABELS)
    if w["tiny"]:
        print(f"targets: not judged on a --tiny smoke run (tiny dims on the host: "
              f"{w['decode_n2'] - w['decode_n1']} decode steps of a tiny model sit inside the "
              f"run-to-run noise; the targets are set for the full workload on a GPU)")
        return
    rt, a = res["ratios"], res["systems"].get("a", {})
    print("targets (ratios; met when the comparison holds):")
    for name, op, target, skipped in (
            ("a_decode_step_over_roofline", "<=", TARGET_ROOFLINE, "(a) skipped"),
            ("a_over_b_tokens_per_s", ">=", TARGET_VS_B, "(b) skipped"),
            ("a_gpu_busy", ">=", TARGET_BUSY, a.get("gpu_busy_note", "(a) skipped"))) + (
            (("d_decode_step_over_a", "<=", TARGET_DET_STEP,
              res["skipped"].get("d", "(d) skipped")),
             ("d_over_a_tokens_per_s", ">=", TARGET_DET_TOKENS,
              res["skipped"].get("d", "(d) skipped")))
            if "d" in res["systems"] or "d" in res["skipped"] else ()) + (
            (("a_over_p_tokens_per_s", ">=", TARGET_QUANT_TOKENS,
              res["skipped"].get("p", "(p) skipped")),)
            if "p" in res["systems"] or "p" in res["skipped"] else ()):
        label, x = RATIO_LABELS[name], rt.get(name)
        if name == "a_decode_step_over_roofline":
            label += f" at B={w['batch']}"
        if x is None:
            print(f"  {label}: n/a ({skipped})")
            continue
        met = x <= target if op == "<=" else x >= target
        of = f"{note}, " if name in res.get("ratio_runs", {}) else ""
        print(f"  {label}: {x:.2f} ({of}target {op} {target}) {'met' if met else 'MISSED'}")


def print_runs(res: dict, rows: dict, fields: tuple, ratios: dict) -> None:
    """``--runs N`` > 1: each round's values of ``rows`` (label: a system's row) for ``fields``
    ((label, field, format)) and each round's ``ratios`` (name in ``res["ratio_runs"]``:
    label), with their medians (the values of the table above)."""
    print(f"runs: {res['runs']}, the systems interleaved round by round; each value above is "
          f"the median of its rounds; per round:")
    for label, r in rows.items():
        if "runs" in r:
            print(f"  {label} " + "; ".join(
                f"{name} {', '.join(format(v, fmt) for v in r['runs'][field])}"
                for name, field, fmt in fields))
    for name, label in ratios.items():
        values = res.get("ratio_runs", {}).get(name)
        if values is not None:
            print(f"  {label}: {', '.join(f'{v:.2f}' for v in values)} (median "
                  f"{res['ratios'][name]:.2f})")
