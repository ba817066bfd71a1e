"""Figures: the band curves hold the exact bounds, and every plot writes a PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bandpo.viz import band_curves, main, plot_compare, plot_run_metrics, read_metrics, select_series


def test_band_curves_hold_the_reference_bounds():
    c = band_curves(0.05, p_min=0.01, points=3)  # p = 0.01, ~0.0999, 0.999 (log-spaced)
    assert c["p"][0] == pytest.approx(0.01) and c["p"][-1] == pytest.approx(0.999)
    # TV closed form at p = 0.01: lower = max(1 - 5, 0) = 0, upper = min(1 + 5, 100) = 6.
    assert c["tv_lower"][0] == 0.0 and c["tv_upper"][0] == pytest.approx(6.0)
    for div in ("kl", "tv", "chi2"):
        assert np.all(c[f"{div}_lower"] <= 1.0) and np.all(c[f"{div}_upper"] >= 1.0)
    # Exact KL band at p = 0.08, delta = 0.05 (the reference table in tests/data/band_bounds.csv): (0.26170, 2.41055).
    c08 = band_curves(0.05, divergences=("kl",), p_min=0.08, points=2)
    assert c08["kl_lower"][0] == pytest.approx(0.26170, abs=1e-5)
    assert c08["kl_upper"][0] == pytest.approx(2.41055, abs=1e-5)


def _metrics(path, shift=0.0):
    rows = [{"step": 0, "eval/x/mean@4": 0.2}]
    rows += [
        {
            "step": s,
            "reward/mean": -0.5 + 0.1 * s + shift,
            "reward/accuracy": 0.25 + 0.05 * s,
            "actor/entropy": 1.0 - 0.1 * s,
            "actor/clip_frac_up": 0.01,
            "actor/clip_frac_bin/lt0.01": 0.0,
            "time/step": float("nan"),
        }
        for s in (1, 2, 3)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 4, "cut off')
    return path


def test_read_and_select_skip_cut_lines_and_non_numbers(tmp_path):
    rows = read_metrics(_metrics(tmp_path / "m.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the half-written last line is skipped
    series = select_series(rows, "clip_frac")
    assert set(series) == {"actor/clip_frac_up", "actor/clip_frac_bin/lt0.01"}
    steps, values = select_series(rows, "reward/mean")["reward/mean"]
    assert steps.tolist() == [1, 2, 3] and values == pytest.approx([-0.4, -0.3, -0.2])
    assert select_series(rows, "time/step") == {}  # NaN is not drawn


def test_plots_write_pngs(tmp_path):
    a, b = _metrics(tmp_path / "a.jsonl"), _metrics(tmp_path / "b.jsonl", shift=0.2)
    for out in (
        plot_run_metrics(a, tmp_path / "run.png"),
        plot_compare({"grpo": [a, b], "bandpo": a}, tmp_path / "cmp.png"),
        main(["band", "--delta", "0.05", "--out", str(tmp_path / "band.png")]),
    ):
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".png") == [
        "band.png",
        "cmp.png",
        "run.png",
    ]
    assert not list(tmp_path.glob(".*tmp*"))  # saved through a temporary file and a rename, none left
