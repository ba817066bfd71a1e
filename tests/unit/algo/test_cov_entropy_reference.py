"""Clip-Cov, KL-Cov, the top-entropy selection and the adaptive entropy bonus against the reference
implementations' own numbers: ``data/cov_entropy_reference.json`` holds generated inputs and what verl's
``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov`` and TRL's ``GRPOTrainer`` (its
``get_high_entropy_mask`` and ``_compute_loss`` with the adaptive bonus, over five steps) returned on them,
run unmodified at the commits the file records, in float64 and float32.

Tolerances: both sides do the same operations in the same order, so the numbers agree to the last bit
in practice; the bound allowed is a different summation order over the ~200 valid tokens of a batch,
200 x 2^-53 ~ 2e-14 relative in float64 (allowed 1e-12) and 200 x 2^-24 ~ 1.2e-5 in float32 (allowed
2e-5), relative to the largest magnitude compared. Selected-token sets must be identical. One exception:
verl computes Clip-Cov's ``pg_clipfrac`` from a float32 cast of its mask, so in a float64 run its value is
a float32 rounding of ours: allowed 2^-24 relative (6e-8; 1e-7 allowed).

``python tests/unit/algo/test_cov_entropy_reference.py`` prints the table of max abs differences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bandpo.algo.cov import clip_cov_tokens, kl_cov_tokens
from bandpo.algo.entropy_bonus import EntropyControl, EntropyController, top_entropy_mask
from bandpo.algo.losses import policy_loss
from bandpo.algo.options import LossOptions

DATA = json.loads((Path(__file__).parent / "data/cov_entropy_reference.json").read_text())
DTYPES = {"float64": torch.float64, "float32": torch.float32}
REL = {"float64": 1e-12, "float32": 2e-5}
FLOAT32_METRICS = {"cov/selected_frac"}  # verl's value is computed in float32 whatever the inputs' dtype
# verl's metric -> ours, per method
METRICS = {
    "clip_cov": {"actor/pg_clipfrac": "cov/selected_frac", "actor/ppo_kl": "cov/kl_k1"},
    "kl_cov": {"actor/ppo_kl": "cov/abs_log_ratio"},
}


def _inputs(enc: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shape = enc["shape"]
    out = {
        k: torch.tensor(enc[k], dtype=torch.float64).reshape(shape).to(dtype)
        for k in ("logp", "old", "adv", "ent")
    }
    out["mask"] = torch.tensor(enc["mask"], dtype=torch.long).reshape(shape)
    return out


def _positions(selected: torch.Tensor) -> list[int]:
    return torch.nonzero(selected.reshape(-1)).squeeze(-1).tolist()


def _max_abs(ours, ref, dtype: torch.dtype = torch.float64) -> float:
    """Max |ours - ref|, ``ref`` read at ``dtype`` first (float32 values are stored as their shortest
    float32 decimal, exact only once cast back to float32)."""
    ref = torch.as_tensor(ref, dtype=torch.float64).to(dtype).double()
    return float((torch.as_tensor(ours, dtype=torch.float64) - ref).abs().max())


def _scale(ref) -> float:
    return max(float(torch.as_tensor(ref, dtype=torch.float64).abs().max()), 1e-30)


def cov_case(case: dict) -> dict:
    """Our numbers on one verl case, and the max abs difference per quantity."""
    dtype = DTYPES[case["dtype"]]
    x = _inputs(DATA["cov"]["inputs"], dtype)
    kind, o = case["kind"], case["options"]
    opts = {"cov_ratio": o.get("clip_cov_ratio", o.get("kl_cov_ratio")), "dual_clip": None}
    if kind == "clip_cov":
        opts.update(clip_cov_lb=o.get("clip_cov_lb"), clip_cov_ub=o.get("clip_cov_ub"))
    else:
        opts["kl_cov_coef"] = o.get("ppo_kl_coef")
    options = LossOptions(algorithm=kind, agg="token-mean", **opts)
    logp = x["logp"].clone().requires_grad_(True)
    torch.manual_seed(case["seed"])  # the draw verl made after the same seeding
    loss, metrics = policy_loss(logp, x["old"], x["adv"], x["mask"], options)
    loss.backward()
    maskf = x["mask"].to(dtype)
    ratio_ = options.cov_ratio or 2e-4
    if kind == "clip_cov":
        r = torch.exp(x["logp"] - x["old"])
        clipped = ((r > 1.2) & (x["adv"] > 0)) | ((r < 0.8) & (x["adv"] < 0))
        torch.manual_seed(case["seed"])
        lb, ub = options.clip_cov_lb or 1.0, options.clip_cov_ub or 5.0
        chosen = clip_cov_tokens(x["logp"], x["adv"], maskf, clipped, ratio_, lb, ub)[0]
    else:
        chosen = kl_cov_tokens(x["logp"], x["adv"], maskf, ratio_)
    diffs = {
        "loss": (_max_abs(loss.item(), case["loss"], dtype), _scale(case["loss"])),
        "grad": (_max_abs(logp.grad.reshape(-1), case["grad_logp"], dtype), _scale(case["grad_logp"])),
    }
    for theirs, ours in METRICS[kind].items():
        diffs[ours] = (
            _max_abs(metrics[ours].item(), case["metrics"][theirs]),
            _scale(case["metrics"][theirs]),
        )
    return {"diffs": diffs, "selected": _positions(chosen), "ref_selected": case["selected"]}


def test_clip_cov_and_kl_cov_equal_verl():
    for case in DATA["cov"]["cases"]:
        out = cov_case(case)
        label = (case["kind"], case["dtype"], case["options"])
        assert out["selected"] == out["ref_selected"] and out["selected"], label
        for name, (diff, scale) in out["diffs"].items():
            rel = max(REL[case["dtype"]], 1e-7) if name in FLOAT32_METRICS else REL[case["dtype"]]
            assert diff <= rel * scale, (label, name, diff)


def trl_run(run: dict) -> list[dict]:
    """Our numbers over one TRL run's steps, each from TRL's controller state before it (c, and the last
    measured entropy: TRL's inf before the first measurement is our None), so that a step where the kept
    sets differ (the documented float64 case) does not carry into the later ones."""
    dtype = DTYPES[run["dtype"]]
    c = run["control"]
    control = EntropyControl(
        c["entropy_target"], c["entropy_coef_delta"], c["entropy_coef_min"], c["entropy_coef_max"]
    )
    ctl = EntropyController(control, run["coef0"])
    out = []
    before = (run["coef0"], None)
    for enc, ref in zip(DATA["trl"]["steps"], run["steps"]):
        ctl.coef, ctl.last_entropy = before
        before = (ref["next_coef"], ref["last_world_entropy"])
        x = _inputs(enc, dtype)
        logp, ent = x["logp"].clone().requires_grad_(True), x["ent"].clone().requires_grad_(True)
        applied = ctl.step_coef()
        options = LossOptions(
            algorithm="grpo",
            dual_clip=None,
            agg="token-mean",
            top_entropy_quantile=run["rho"],
            entropy_coef=applied,
            entropy_control=control,
        )
        # TRL's bnpo: the micro-batch's own token count; dapo: the batch's (here one micro-batch)
        num_tokens = float(x["mask"].sum()) if run["loss_type"] == "dapo" else None
        adv = x["adv"][:, 0]  # [N]: one advantage per sequence, as TRL's GRPO gets
        loss, metrics = policy_loss(
            logp, x["old"], adv, x["mask"], options, num_tokens=num_tokens, entropy=ent
        )
        loss.backward()
        measured_metrics = {k: float(v) for k, v in metrics.items()}
        step = ctl.observe(measured_metrics)
        maskf = x["mask"].to(dtype)
        kept = top_entropy_mask(ent, maskf, run["rho"]) if run["rho"] < 1 else maskf.bool()
        grad_ent = torch.zeros_like(ent) if ent.grad is None else ent.grad
        out.append(
            {
                "kept": _positions(kept),
                "ref_kept": ref["kept"],
                "applied_coef": (applied, ref["applied_coef"]),
                "next_coef": (step["entropy_bonus/next_coef"], ref["next_coef"]),
                "measured": (step["entropy_bonus/measured"], ref["last_world_entropy"]),
                "loss": (loss.item(), ref["loss"]),
                "grad": (logp.grad.reshape(-1), ref["grad_logp"]),
                "grad_entropy": (grad_ent.reshape(-1), ref["grad_entropy"]),
                "entropy": x["ent"],
                "tau": None,
            }
        )
    return out


def test_top_entropy_selection_and_adaptive_bonus_equal_trl():
    for run in DATA["trl"]["runs"]:
        label = (run["loss_type"], run["rho"], run["dtype"])
        for i, step in enumerate(trl_run(run)):
            # the coefficient applied: the same float arithmetic on the same state, exactly equal
            assert step["applied_coef"][0] == step["applied_coef"][1], (label, i)
            if step["kept"] != step["ref_kept"]:
                # float64 only, the documented difference: TRL compares the float64 entropy with the
                # float32 quantile and drops a token lying below its own float32 rounding; we keep it.
                assert run["dtype"] == "float64" and set(step["ref_kept"]) < set(step["kept"]), (label, i)
                h = step["entropy"].reshape(-1)
                for t in set(step["kept"]) - set(step["ref_kept"]):
                    assert float(h[t]) < float(h[t].float()), (label, i, t)
                continue
            assert step["next_coef"][0] == step["next_coef"][1], (label, i)
            for name in ("measured", "loss", "grad", "grad_entropy"):
                ours, ref = step[name]
                assert _max_abs(ours, ref, DTYPES[run["dtype"]]) <= REL[run["dtype"]] * _scale(ref), (
                    label,
                    i,
                    name,
                )


def table() -> list[tuple]:
    """Rows (method, dtype, options, quantity, max abs difference) over every reference case."""
    rows = []
    for case in DATA["cov"]["cases"]:
        out = cov_case(case)
        for name, (diff, _) in out["diffs"].items():
            rows.append((case["kind"], case["dtype"], json.dumps(case["options"]), name, diff))
        rows.append(
            (
                case["kind"],
                case["dtype"],
                json.dumps(case["options"]),
                "selected set differs",
                float(out["selected"] != out["ref_selected"]),
            )
        )
    for run in DATA["trl"]["runs"]:
        steps = trl_run(run)
        what = f"{run['loss_type']} rho={run['rho']}"
        differ = [s["kept"] != s["ref_kept"] for s in steps]
        rows.append(("trl-entropy", run["dtype"], what, "steps whose kept set differs", float(sum(differ))))
        steps = [s for s, d in zip(steps, differ) if not d]  # the others: the documented float64 case
        for name in ("applied_coef", "next_coef", "measured", "loss", "grad", "grad_entropy"):
            dtype = torch.float64 if name.endswith("coef") else DTYPES[run["dtype"]]  # coefficients: floats
            diff = max((_max_abs(*s[name], dtype) for s in steps), default=float("nan"))
            rows.append(("trl-entropy", run["dtype"], what, name, diff))
    return rows


if __name__ == "__main__":
    for row in table():
        print(" | ".join(str(c) for c in row[:4]), "|", f"{row[4]:.3g}")
