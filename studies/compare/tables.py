"""The markdown sections of ``studies.compare.report``'s report, from the runs' summaries (``studies.compare.runs``):
command and machine, budget, held-out accuracy, entropy over steps, clip fraction by old-probability
bin, one line per run; and the cell and table formatting they share."""

from __future__ import annotations

import os
import platform
import statistics
import time

from bandpo.distributed.precision import cpu_name
from bandpo.viz import clip_label, report_datasets
from studies.compare.runs import _mean, budget_check

# The per-bin clip fractions by sign (``bandpo.algo.losses``); the unsigned ``clip_frac_bin/`` is their sum.
SIGNED = ("clip_frac_bin_up/", "clip_frac_bin_down/")


def _shared_before_note(summaries: dict[str, list[dict]]) -> list[str]:
    shared = [s for group in summaries.values() for s in group if s.get("before_from")]
    if not shared:
        return []
    sources = ", ".join(sorted({f"`{s['before_from']}`" for s in shared}))
    return [
        f"Runs that did not evaluate before step 1 ({len(shared)}): their *before* is the step-0 evaluation of "
        "the run with the same seed, model and eval settings that did (the same model, prompts and "
        f"sampling seed: the same numbers), from {sources}."
    ]


def mean_std(values: list[float | None], scale: float = 1.0, digits: int = 1) -> str:
    """``"mean ± std"`` over the values present (sample std; just the mean for one value; "n/a" for none)."""
    values = [scale * v for v in values if v is not None]
    if not values:
        return "n/a"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def _header_section(commands: list[str], summaries: dict[str, list[dict]]) -> list[str]:
    times = [s["times"] for group in summaries.values() for s in group]
    starts = [start for start, _ in times if start is not None]
    ends = [end for _, end in times if end is not None]
    span = f"{_date(min(starts)) if starts else '?'} to {_date(max(ends)) if ends else '?'}"
    if undated := sum(end is None for _, end in times):
        span += f" ({undated} recorded without their times, not counted)"
    u = platform.uname()
    return [
        "## Command and machine",
        "",
        "```",
        *commands,
        "```",
        "",
        f"- machine: `{u.system} {u.release} {u.machine}`, {cpu_name()}, {os.cpu_count()} CPUs (nproc)",
        f"- runs: {span}",
        f"- summarised: {_date(time.time())} (load average {os.getloadavg()[0]:.1f})",
        "",
    ]


def _budget_section(summaries: dict[str, list[dict]]) -> list[str]:
    same, differ = budget_check([s for group in summaries.values() for s in group])
    lines = [
        "## Budget",
        "",
        "Settings every run shares:",
        "",
        *[f"- `{k}` = `{v}`" for k, v in same.items()],
        "",
    ]
    if not differ:
        return lines + ["Equal budgets: of the settings checked, only the algorithm and the seed differ.", ""]
    lines += ["**Warning: the runs do not share these settings (not an equal-budget comparison):**", ""]
    lines += [
        f"- `{k}`: " + ", ".join(f"{f}: `{v}`" for f, v in values.items()) for k, values in differ.items()
    ]
    return lines + [""]


def _accuracy_section(summaries: dict[str, list[dict]]) -> list[str]:
    datasets = report_datasets(summaries)
    head = ["algorithm", "seeds", "steps"]
    for d in datasets:
        head += [f"{d} before", f"{d} after", f"{d} Δ"]
    lines = [
        "## Held-out accuracy and entropy",
        "",
        "Mean ± sample std over seeds; accuracies in %. Δ is after − before within each seed. Final entropy: "
        "the last step's rollout entropy (nats per token), sampled before that step's update, so it measures "
        "every update but the last.",
        *_shared_before_note(summaries),
        "",
        *_table_head([*head, "final entropy"]),
    ]
    for label, group in summaries.items():
        cells = [label, ", ".join(str(s["seed"]) for s in group), _steps(group)]
        for d in datasets:
            pairs = [(s["before"].get(d), s["after"].get(d)) for s in group]
            cells += [
                mean_std([b for b, _ in pairs], 100),
                mean_std([a for _, a in pairs], 100),
                mean_std([a - b if a is not None and b is not None else None for b, a in pairs], 100),
            ]
        lines.append(_row([*cells, mean_std([s["entropy"] for s in group], digits=3)]))
    return lines + [""]


def _entropy_section(summaries: dict[str, list[dict]]) -> list[str]:
    """Mean token entropy of the rollouts at the first, middle and last step (the paper's collapse claim)."""
    return _by_step_section(
        summaries,
        "entropy_by_step",
        "Entropy over steps",
        "Mean token entropy of each step's rollout under pi_old (nats)",
        digits=3,
    )


def _length_section(summaries: dict[str, list[dict]]) -> list[str]:
    """Mean response length of the rollouts by step; none for runs that logged no length."""
    if not any(
        v is not None for group in summaries.values() for s in group for v in s["length_by_step"].values()
    ):
        return []
    return _by_step_section(
        summaries,
        "length_by_step",
        "Response length over steps",
        "Mean length of each step's rollout responses (tokens)",
        digits=1,
    )


def _by_step_section(
    summaries: dict[str, list[dict]], field: str, title: str, what: str, digits: int
) -> list[str]:
    """A table of ``summary[field]`` ({step: value}) at the first, quarter and last steps, per label."""
    last = max((s["steps"] for group in summaries.values() for s in group), default=0)
    steps = sorted({1, *(round(last * q / 4) for q in (1, 2, 3, 4))} - {0})
    if not steps:
        return []
    # The last five steps every run has: where runs stopped early, the ends compare at equal steps.
    common = min(s["steps"] for group in summaries.values() for s in group)
    window = range(max(1, common - 4), common + 1)
    lines = [
        f"## {title}",
        "",
        f"{what}, mean ± sample std over seeds; the last column averages each run's steps "
        f"{window[0]}-{window[-1]}: the last five steps that every run has, or all of them where there are fewer.",
        "",
        *_table_head(["algorithm", *[f"step {t}" for t in steps], f"steps {window[0]}-{window[-1]}"]),
    ]
    for label, group in summaries.items():
        ends = [_mean([s[field].get(t) for t in window]) for s in group]
        lines.append(
            _row(
                [
                    label,
                    *[mean_std([s[field].get(t) for s in group], digits=digits) for t in steps],
                    mean_std(ends, digits=digits),
                ]
            )
        )
    return lines + [""]


def _clip_section(summaries: dict[str, list[dict]]) -> list[str]:
    found = {k for group in summaries.values() for s in group for k in s["clip"]}
    keys = sorted(
        (k for k in found if k.startswith("clip_frac") and not k.startswith(SIGNED)), key=_clip_order
    )
    bins = [k for k in keys if k.startswith("clip_frac_bin/")]
    lines = [
        "## Clip fraction by old-probability bin",
        "",
        (
            "Per bin of old probability p: the fraction of that bin's tokens whose gradient the clip "
            "removed, up-clips (A > 0) and down-clips (A < 0) together; the last columns are fractions of "
            "all tokens. Averaged over each run's training steps, then mean ± sample std over seeds (%)."
        ),
        "",
        *_table_head(["algorithm", *[clip_label(k) for k in keys]]),
    ]
    lines += _clip_rows(summaries, keys)
    lines += [""] + _signed_table(summaries, found, bins)
    lines += [
        "Share of response tokens in each bin (%), for scale:",
        "",
        *_table_head(["algorithm", *[clip_label(b) for b in bins]]),
    ]
    lines += _clip_rows(summaries, [b.replace("clip_frac_bin/", "token_frac_bin/") for b in bins])
    return lines + [""]


def _signed_table(summaries: dict[str, list[dict]], found: set[str], bins: list[str]) -> list[str]:
    """The bins split by sign, where the runs logged it (``clip_frac_bin_up/`` and ``_down/``); none otherwise."""
    if not any(k.startswith(SIGNED) for k in found):
        return []
    keys = [b.replace("clip_frac_bin/", prefix) for b in bins for prefix in SIGNED]
    lines = [
        (
            "The same bins split by sign (%): up, the tokens with A > 0 cut for moving past the upper limit "
            "(the gradient that would raise a rewarded token); down, those with A < 0 cut below the lower limit. "
            "Up and down add up to the table above (CISPO: clipped weights by side, whatever the sign of A). "
            "n/a: runs that did not log the split."
        ),
        "",
        *_table_head(["algorithm", *[clip_label(k) for k in keys]]),
    ]
    return lines + _clip_rows(summaries, keys) + [""]


def _clip_rows(summaries: dict[str, list[dict]], keys: list[str]) -> list[str]:
    """One row per algorithm: each key's per-run mean, mean ± sample std over seeds, in %."""
    return [
        _row([label, *[mean_std([s["clip"].get(k) for s in group], 100, 2) for k in keys]])
        for label, group in summaries.items()
    ]


def _runs_section(summaries: dict[str, list[dict]]) -> list[str]:
    datasets = report_datasets(summaries)
    lines = [
        "## Runs",
        "",
        "Train time: the training steps' own time; wall: from the run's start to its last "
        "line (start-up and evaluations included). Actor peak: the largest `actor/peak_memory_gib` "
        "logged (on a CPU the actor process's peak resident memory, libraries included).",
        "",
        *_table_head(
            [
                "run",
                "steps",
                *[f"{d} before → after (%)" for d in datasets],
                "final entropy",
                "train time (s)",
                "wall (s)",
                "actor peak (GiB)",
            ]
        ),
    ]
    for s in (s for group in summaries.values() for s in group):
        evals = [f"{_pct(s['before'].get(d))} → {_pct(s['after'].get(d))}" for d in datasets]
        state = "" if s["finished"] else " (unfinished)"
        entropy = f"{s['entropy']:.3f}" if s["entropy"] is not None else "n/a"
        lines.append(
            _row(
                [
                    f"`{s['folder']}`",
                    f"{s['steps']}/{s['total_steps']}{state}",
                    *evals,
                    entropy,
                    f"{s['train_s']:.0f}",
                    f"{s['wall_s']:.0f}" if s["wall_s"] is not None else "n/a",
                    f"{s['actor_peak_gib']:.2f}" if s.get("actor_peak_gib") is not None else "n/a",
                ]
            )
        )
    return lines + [""]


def _date(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(timestamp))


def _clip_order(key: str) -> tuple[int, str]:
    # Bins in probability order (as the loss defines them), then the totals: up, down, dual.
    from bandpo.algo.losses import PROB_BIN_NAMES

    name = key.removeprefix("clip_frac_bin/")
    if name in PROB_BIN_NAMES:
        return PROB_BIN_NAMES.index(name), ""
    totals = ("clip_frac_up", "clip_frac_down", "clip_frac_dual")
    return len(PROB_BIN_NAMES) + (totals.index(key) if key in totals else len(totals)), key


def _steps(group: list[dict]) -> str:
    """Steps done / planned of a group of seeds, as a range where the seeds differ ("5-12/12")."""

    def span(values):
        known = sorted({v for v in values if v is not None})
        if not known:
            return "?"
        return str(known[0]) if len(known) == 1 else f"{known[0]}-{known[-1]}"

    return f"{span([s['steps'] for s in group])}/{span([s['total_steps'] for s in group])}"


def _pct(v: float | None) -> str:
    return f"{100 * v:.1f}" if v is not None else "n/a"


def _table_head(cells: list[str]) -> list[str]:
    return [_row(cells), _row(["---"] * len(cells))]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
