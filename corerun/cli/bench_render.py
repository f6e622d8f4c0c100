"""``corerun bench``'s summary lines for the runs it makes in turn with a feature off and on
(asynchronous scheduling, speculative decoding, LoRA adapters against the base alone)."""

from __future__ import annotations

from typing import Any

import click


def render_on_off(doc: dict[str, Any]) -> None:
    """One line for each off/on comparison ``doc`` holds."""
    if "async_scheduling" in doc:
        _line(doc, "async_scheduling", "async scheduling", ("sync", "async"), "synchronous")
    if "speculative" in doc:
        s = doc["speculative"]
        _line(
            doc, "speculative",
            f"speculative decoding ({s['method']}, K={s['num_tokens']}, lookup {s['prompt_lookup_min']}:"
            f"{s['prompt_lookup_max']}) on a {doc['workload']['kind']} workload", ("off", "on"), "off",
            f"; drafts proposed {s['proposed']}, accepted {s['accepted']} ({s['acceptance_rate']:.0%}), mean accepted "
            f"length {s['mean_accepted_length']:.2f}", sampled_note=" (seeded)")
    if "lora" in doc:
        s = doc["lora"]
        _line(doc, "lora", f"{s['num_adapters']} LoRA adapters of rank {s['rank']} ({s['max_loras']} slots)",
              ("base", "lora"), "base alone")


def _line(
    doc: dict[str, Any], key: str, title: str, names: tuple[str, str], off_label: str, details: str = "",
    sampled_note: str | None = None,
) -> None:
    """The summary line of an off/on run: ``doc[key]`` with throughputs under ``{names[i]}_output_tokens_per_s``;
    ``details`` goes before the outputs compared, which sampled runs report only with a ``sampled_note``."""
    s, w = doc[key], doc["workload"]
    greedy = w["temperature"] == 0
    same = f"; outputs identical for {s['same_outputs']} of {w['num_seqs']} requests"
    click.echo(
        f"{title}: {max(s[f'{names[1]}_output_tokens_per_s']):.1f} output tok/s, {off_label} "
        f"{max(s[f'{names[0]}_output_tokens_per_s']):.1f} (fastest of {s['rounds']} interleaved rounds each): "
        f"{s['speedup']:.3f}x; per round " + ", ".join(f"{x:.3f}x" for x in s["speedup_per_round"]) + details
        + (same if greedy else "" if sampled_note is None else same + sampled_note)
    )

