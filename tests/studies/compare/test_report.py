"""studies/compare/report.py: the replication report from hand-written runs (numbers by hand)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from studies.compare import report as compare


@pytest.fixture
def curves_not_drawn(monkeypatch) -> list[list[str]]:
    """The report's curves figure (``bandpo.viz``: ~1 s of matplotlib a figure) is drawn and checked by
    test_report_tables_are_the_hand_computed_means; the other tests here check tables, so they record
    what the report asks ``bandpo.viz`` for instead of drawing it."""
    asked: list[list[str]] = []
    monkeypatch.setattr(compare, "viz_main", asked.append)
    return asked


def _run(folder: Path, before: float, after: float, entropy: list[float], clip_lt: list[float]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("trainer:\n  total_steps: 2\nactor:\n  lr: 0.0003\n")
    key = "eval/tiny_arith_test/mean@32"
    rows = [{"step": 0, key: before}]
    for step, (ent, clip) in enumerate(zip(entropy, clip_lt), start=1):
        rows.append(
            {
                "step": step,
                "time/step": 1.5,
                "actor/peak_memory_gib": 0.5 + 0.25 * step,
                "actor/entropy": ent,
                "actor/clip_frac_up": clip / 10,
                "actor/clip_frac_bin/lt0.01": clip,
                "actor/token_frac_bin/lt0.01": 0.02,
            }
        )
    rows.append({"step": 2, "final": True, key: after})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_tables_are_the_hand_computed_means(tmp_path):
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    _run(runs / "grpo-s1", 0.70, 0.77, [0.10, 0.07], [0.2, 0.2])
    _run(runs / "bandpo_d0.1-s0", 0.70, 0.72, [0.10, 0.09], [0.0, 0.0])
    reading = tmp_path / "reading.md"
    reading.write_text("GRPO gains more here; one seed of the arm.\n")
    out = compare.main(
        ["--runs", str(runs), "--out", str(tmp_path / "results.md"), "--reading", str(reading)]
    )
    text = out.read_text()
    assert "## Reading\n\nGRPO gains more here; one seed of the arm." in text
    # grpo: before 70.0 both seeds, after 75 and 77 -> 76.0 ± 1.4 (sample std of 75, 77 = sqrt(2)),
    # delta 5 and 7 -> 6.0 ± 1.4; final entropy 0.05, 0.07 -> 0.060 ± 0.014.
    assert "| grpo | 0, 1 | 2/2 | 70.0 ± 0.0 | 76.0 ± 1.4 | 6.0 ± 1.4 | 0.060 ± 0.014 |" in text
    # a one-seed arm has no spread; listed after the three algorithms (LABEL_ORDER)
    assert "| bandpo_d0.1 | 0 | 2/2 | 70.0 | 72.0 | 2.0 | 0.090 |" in text
    # entropy at steps 1 and 2: grpo (0.10, 0.10) -> 0.100 ± 0.000, (0.05, 0.07) -> 0.060 ± 0.014;
    # steps 1-2 per seed: 0.075 and 0.085 -> 0.080 ± 0.007 (sample std 0.01 / sqrt(2))
    assert "| grpo | 0.100 ± 0.000 | 0.060 ± 0.014 | 0.080 ± 0.007 |" in text
    assert text.index("| grpo |") < text.index("| bandpo_d0.1 |")
    # clip fraction of the p < 0.01 bin: mean over steps, then over seeds: (0.3, 0.2) -> 25.0 %
    assert "| grpo | 25.00 ± 7.07 | 2.50 ± 0.71 |" in text
    assert (tmp_path / "results.png").stat().st_size > 0
    # the Runs table: 2 steps of 1.5 s; the actor's peak is the largest logged, 0.5 + 0.25 * 2
    assert "| 2/2 | 70.0 → 75.0 | 0.050 | 3 | 0 | 1.00 |" in text  # wall: from the file times, ~0 s


def test_a_recorded_run_keeps_its_wall_time_and_dates(tmp_path, curves_not_drawn):
    """A run compare.sh restored from its RECORD has fresh file times; its start and end are the times
    file's; an older record with only wall_s keeps its wall time and is left out of the dates."""
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    (runs / "grpo-s0" / "times").write_text("1795820400 1795821154\n")  # 2026-11-27 23:00:00 and 23:12:34 UTC
    start, end = (time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(t)) for t in (1795820400, 1795821154))
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    assert "| 2/2 | 70.0 → 75.0 | 0.050 | 3 | 754 | 1.00 |" in text
    assert f"- runs: {start} to {end}\n" in text
    _run(runs / "grpo-s1", 0.70, 0.77, [0.10, 0.07], [0.2, 0.2])
    (runs / "grpo-s1" / "wall_s").write_text("800\n")
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    assert "| 2/2 | 70.0 → 77.0 | 0.070 | 3 | 800 | 1.00 |" in text
    assert f"- runs: {start} to {end} (1 recorded without their times, not counted)\n" in text


def test_response_length_by_step(tmp_path, curves_not_drawn):
    """Each step's mean response length gets a table like entropy's; runs without it get none."""
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    report = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")])
    assert "## Response length over steps" not in report.read_text()
    _run(runs / "grpo-s1", 0.70, 0.77, [0.10, 0.07], [0.2, 0.2])
    for folder, lengths in ((runs / "grpo-s0", [40.0, 50.0]), (runs / "grpo-s1", [44.0, 60.0])):
        rows = [json.loads(r) for r in (folder / "metrics.jsonl").read_text().splitlines()]
        for row, length in zip(rows[1:3], lengths):
            row["response/length_mean"] = length
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    # step 1: 40, 44 -> 42.0 ± 2.8 (sample std 4 / sqrt(2)); step 2: 50, 60 -> 55.0 ± 7.1;
    # steps 1-2 per seed: 45 and 52 -> 48.5 ± 4.9 (7 / sqrt(2))
    assert "## Response length over steps" in text
    assert "| grpo | 42.0 ± 2.8 | 55.0 ± 7.1 | 48.5 ± 4.9 |" in text


def test_shared_before_maj_and_headline(tmp_path, curves_not_drawn):
    """A run that skipped its step-0 evaluation (compare.sh SHARED_BEFORE=1) takes the one of the run
    with its seed and model; maj@n gets its own columns; --headline draws the extra figure."""
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    _run(runs / "bandpo-s0", 0.70, 0.80, [0.10, 0.09], [0.0, 0.0])
    rows = (runs / "bandpo-s0" / "metrics.jsonl").read_text().splitlines()
    bandpo = [json.loads(r) for r in rows[1:]]  # drop its step-0 evaluation
    bandpo[-1]["eval/tiny_arith_test/maj@32"] = 0.85
    (runs / "bandpo-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bandpo))
    grpo = [json.loads(r) for r in (runs / "grpo-s0" / "metrics.jsonl").read_text().splitlines()]
    grpo[0]["eval/tiny_arith_test/maj@32"], grpo[-1]["eval/tiny_arith_test/maj@32"] = 0.74, 0.78
    (runs / "grpo-s0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in grpo))
    out = compare.main(
        ["--runs", str(runs), "--out", str(tmp_path / "results.md"), "--headline", "--title", "entropy"]
    )
    text = out.read_text()
    assert text.startswith("# entropy\n\n![headline](results-headline.png)")
    # columns: mean@32 before/after/delta, then maj@32 before/after/delta; bandpo's before is grpo's
    # step 0 (70.0 and 74.0), so its deltas are 80 - 70 = 10.0 and 85 - 74 = 11.0.
    assert "| grpo | 0 | 2/2 | 70.0 | 75.0 | 5.0 | 74.0 | 78.0 | 4.0 | 0.050 |" in text
    assert "| bandpo | 0 | 2/2 | 70.0 | 80.0 | 10.0 | 74.0 | 85.0 | 11.0 | 0.090 |" in text
    assert "Runs that did not evaluate before step 1 (1)" in text
    assert (tmp_path / "results-headline.png").stat().st_size > 0


def test_before_from_runs_not_reported(tmp_path, curves_not_drawn):
    """--before-runs: a run without a step-0 evaluation borrows one from a folder that is not reported."""
    _run(tmp_path / "stopped" / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    _run(tmp_path / "runs" / "bandpo-s0", 0.0, 0.80, [0.10, 0.09], [0.0, 0.0])
    path = tmp_path / "runs" / "bandpo-s0" / "metrics.jsonl"
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[1:]))
    out = compare.main(
        [
            "--runs",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "results.md"),
            "--before-runs",
            str(tmp_path / "stopped"),
        ]
    )
    text = out.read_text()
    assert "| bandpo | 0 | 2/2 | 70.0 | 80.0 | 10.0 | 0.090 |" in text  # 80 - 70
    assert "| grpo |" not in text and f"`{tmp_path / 'stopped' / 'grpo-s0'}`" in text


def test_pass_at_n_follows_mean_and_maj(tmp_path, curves_not_drawn):
    """pass@n (n = the mean's sample count) gets the last columns of its dataset; other pass@k are left out."""
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    path = runs / "grpo-s0" / "metrics.jsonl"
    rows = [json.loads(r) for r in path.read_text().splitlines()]
    for row, (maj, pass_n) in ((rows[0], (0.74, 0.95)), (rows[-1], (0.78, 0.90))):
        row.update(
            {
                "eval/tiny_arith_test/maj@32": maj,
                "eval/tiny_arith_test/pass@32": pass_n,
                "eval/tiny_arith_test/pass@4": 0.5,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    # mean@32 70 -> 75 (+5.0), maj@32 74 -> 78 (+4.0), pass@32 95 -> 90 (-5.0)
    assert "| grpo | 0 | 2/2 | 70.0 | 75.0 | 5.0 | 74.0 | 78.0 | 4.0 | 95.0 | 90.0 | -5.0 | 0.050 |" in text
    assert "pass@4" not in text


def test_headline_cuts_a_sequence_level_outlier():
    """One label over 3x the others (GSPO clips whole responses) is cut at 1.5x the others' tallest bar
    and labelled; without an outlier the axis is left alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bandpo.viz import _cut_outlier_bars as cut

    fig, ax = plt.subplots()
    cut(ax, {"grpo": ([0.0, 1.0], [1.8, 2.0]), "gspo": ([0.1, 1.1], [21.0, 16.0])})
    assert ax.get_ylim() == (0.0, 3.0)  # 1.5 * 2.0
    assert [t.get_text() for t in ax.texts] == ["gspo\n21%", "gspo\n16%"]
    fig2, ax2 = plt.subplots()
    ax2.set_ylim(0, 10)
    cut(ax2, {"grpo": ([0.0], [2.0]), "bandpo": ([0.1], [5.0])})  # 5.0 <= 3 * 2.0: no cut
    assert ax2.get_ylim() == (0.0, 10.0) and not ax2.texts
    plt.close(fig)
    plt.close(fig2)


def test_signed_bins_get_their_own_table(tmp_path, curves_not_drawn):
    """Runs that log the bins by sign get a table of up- and down-clips by bin; a run that does not shows
    n/a there, and the unsigned table is unchanged. Runs without them (the tests above) get no such table."""
    runs = tmp_path / "runs"
    _run(runs / "grpo-s0", 0.70, 0.75, [0.10, 0.05], [0.2, 0.4])
    _run(runs / "grpo-s1", 0.70, 0.77, [0.10, 0.07], [0.2, 0.2])
    _run(runs / "bandpo-s0", 0.70, 0.72, [0.10, 0.09], [0.0, 0.0])
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    assert "split by sign" not in text
    for folder, ups in ((runs / "grpo-s0", [0.05, 0.1]), (runs / "grpo-s1", [0.05, 0.05])):
        path = folder / "metrics.jsonl"
        rows = [json.loads(r) for r in path.read_text().splitlines()]
        for row, up in zip(rows[1:3], ups):
            row["actor/clip_frac_bin_up/lt0.01"] = up
            row["actor/clip_frac_bin_down/lt0.01"] = row["actor/clip_frac_bin/lt0.01"] - up
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = compare.main(["--runs", str(runs), "--out", str(tmp_path / "results.md")]).read_text()
    # grpo, p < 0.01, mean over steps then seeds: up (0.05, 0.1) -> 7.5 and (0.05, 0.05) -> 5.0: 6.25 ± 1.77
    # (sample std 2.5 / sqrt(2)); down (0.15, 0.3) -> 22.5 and (0.15, 0.15) -> 15.0: 18.75 ± 5.30
    assert "| algorithm | p < 0.01, up | p < 0.01, down |" in text
    assert "| grpo | 6.25 ± 1.77 | 18.75 ± 5.30 |" in text
    assert "| bandpo | n/a | n/a |" in text
    assert "| grpo | 25.00 ± 7.07 | 2.50 ± 0.71 |" in text  # the unsigned table as before
