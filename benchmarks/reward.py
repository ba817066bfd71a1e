"""Benchmark the reward pool against a plain sequential ``verify_one`` loop.

Builds ``--n`` responses (default 4,096) from the gold answers of ``--data-dir``
(``*.jsonl`` with an ``answer`` field): correct, wrong and messy forms, plus ``--patho``
(default 1%) pathological inputs that hang or choke sympy. Then, in one run:

1. sequential: ``verify_one`` in a loop over the clean items (the pathological ones would
   hang it), in a fresh process — throughput and per-item latency p50/p99;
2. pool, clean items, ``dedupe=False``: every item graded in a worker (pure parallelism);
3. pool, clean items, defaults: each distinct (answer, gold) pair graded once;
4. pool, all items: clean + pathological, to show that the pathological part costs about
   its timeouts (timed-out jobs x timeout / workers) and nothing more.

Every run starts cold (fresh processes, empty parse caches, as at a new training step);
pool start-up is excluded. ``--repeat`` keeps the best wall time of interleaved repeats.
On a shared machine wall times say little: Linux's autogroup scheduling gives each
session one share however many processes it runs, so a busy neighbour caps the pool at
about the CPU a single process gets. CPU seconds (this process plus its workers, via
psutil) are therefore printed too, with an idle-cores projection of the speedup:
sequential CPU / max(pool CPU / workers, CPU of its busiest process).

An item is *lost* if it has no result, *wrong* if its status differs from the label it
was built with (pathological items: from the set of statuses allowed for its kind) or,
for clean items, from the sequential loop's status. Both must be 0.

Usage: ``python -m benchmarks.reward [--workers 2] [--timeout 3] [--out bench.json]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bandpo.reward import RewardScorer, verify_one

REPO = Path(__file__).resolve().parents[1]

_SENTENCES = [
    "Let $x$ denote the unknown quantity, so that $3x + {a} = {b}$.",
    "Squaring both sides gives $x^2 = {b}$, hence $x = \\sqrt{{{b}}}$ or $x = -\\sqrt{{{b}}}$.",
    "By the triangle inequality, ${a} < {b} + {c}$, which rules out the degenerate case.",
    "We count the cases: there are $\\binom{{{a}}}{{2}} = {b}$ pairs in total.",
    "Substituting back, $f({a}) = {b} \\cdot {c} - {a} = {d}$.",
    "Note that $\\frac{{{a}}}{{{b}}}$ is already in lowest terms since $\\gcd({a}, {b}) = 1$.",
    "The area of the region is $\\frac{{1}}{{2}} \\cdot {a} \\cdot {b} = {c}$.",
    "Modulo ${a}$, the sequence repeats with period ${b}$.",
    "This is consistent with the earlier estimate, so we proceed.",
    "Checking small cases by hand confirms the pattern for $n \\le {a}$.",
]
_WORDS = ["so", "we", "keep", "going", "with", "the", "argument", "and", "check", "every", "case"]


def _reasoning(rng: random.Random, chars: int) -> str:
    """Plausible-looking math prose of about ``chars`` characters."""
    out, size = [], 0
    while size < chars:
        nums = {k: rng.randint(2, 999) for k in "abcd"}
        s = rng.choice(_SENTENCES).format(**nums)
        out.append(s)
        size += len(s) + 1
    return " ".join(out)


def _words(rng: random.Random, chars: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(chars // 5))


def _int_forms(a: int) -> tuple[list[str], list[str], list[str]]:
    """(correct, wrong, messy-correct) final-answer tails for an integer gold ``a``."""
    correct = [
        f"Answer: {a}",
        f"Answer: ${a}$",
        f"Therefore the answer is $\\boxed{{{a}}}$.",
        f"Answer: \\boxed{{{a}}}",
        f"\\[\\boxed{{{a}}}\\]",
        f"\\fbox{{{a}}}",
    ]
    wrong = [
        f"Answer: {a + 1}",
        f"Answer: ${a - 1}$",
        f"Answer: {-a}",
        f"The answer is $\\boxed{{{2 * a}}}$.",
        f"Answer: \\frac{{{a}}}{{{abs(a) + 2}}}",
        f"Answer: {a}.5",
        f"Answer: {a}\\sqrt{{2}}",
    ]
    messy = [
        f"**Answer:** {a}",
        f"Answer: ${a}$.",
        f"Answer: $x = {a}$",
        f"Answer: \\frac{{{2 * a}}}{{2}}",
        f"Answer: {a}.0",
        f"Answer: {a} \\text{{ units}}",
        f"Answer: {a:03d}",
        f"Answer: \\({a}\\)",
        f"First I thought $\\boxed{{{a + 3}}}$, but that double counts.\n\nAnswer: {a}",
        f"Answer: $\\boxed{{{a}}}$",
        f"The final answer is ${a}$. I hope it is correct.",
        f"Answer:\n\n{a}",
    ]
    if a >= 1000:
        messy += [f"Answer: {a:,}", f"Answer: ${a:,}$".replace(",", "{,}")]
    return correct, wrong, messy


# (kind, response builder, statuses that count as right for it)
_PATHOLOGICAL = [
    ("power_tower", lambda a: "So it is \\boxed{9^{9^{9^{9^{9}}}}}", {"timeout"}),
    ("huge_power", lambda a: "Answer: 10^{10^{100}}", {"timeout"}),
    ("huge_factorial", lambda a: "Answer: $(10^{10^{10}})!$", {"timeout"}),
    (
        "deep_braces",
        lambda a: "\\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
        {"timeout", "incorrect", "error"},
    ),
    ("long_digits", lambda a: "Answer: " + "9" * 20000, {"incorrect", "timeout"}),
    ("huge_response", lambda a: ("lorem ipsum " * 40000) + f"\nAnswer: {a}", {"correct"}),
]


def build_items(answers: list[str], n: int, patho_frac: float, seed: int) -> list[dict]:
    """``n`` items ``{response, gold, expected (set of statuses), kind}`` in shuffled order."""
    rng = random.Random(seed)
    n_patho = round(n * patho_frac)
    items = []
    for k in range(n - n_patho):
        gold = rng.choice(answers)
        a = int(gold)
        correct, wrong, messy = _int_forms(a)
        u = rng.random()
        if u < 0.40:
            kind, tail, expected = "correct", rng.choice(correct), "correct"
        elif u < 0.75:
            kind, tail, expected = "wrong", rng.choice(wrong), "incorrect"
        elif u < 0.97:
            kind, tail, expected = "messy", rng.choice(messy), "correct"
        else:
            kind, tail, expected = "no_answer", "", "no_answer"
        if kind == "no_answer":
            response = _reasoning(rng, rng.randint(500, 3000)) + " " + _words(rng, 2500)
        else:
            response = _reasoning(rng, rng.randint(500, 6000)) + "\n\n" + tail
        items.append({"response": response, "gold": gold, "expected": {expected}, "kind": kind})
    for k in range(n_patho):
        kind, build, allowed = _PATHOLOGICAL[k % len(_PATHOLOGICAL)]
        gold = rng.choice(answers)
        items.append({"response": build(int(gold)), "gold": gold, "expected": allowed, "kind": kind})
    rng.shuffle(items)
    return items


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _tree_cpu() -> dict[int, float]:
    """CPU seconds used so far by this process and each live descendant (the workers).

    Wall-clock speedups are only meaningful on an otherwise idle machine; CPU accounting
    shows the pool's overhead either way. Needs psutil; empty without it.
    """
    try:
        import psutil
    except ImportError:
        return {}
    out = {}
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:  # a worker that ended meanwhile
            pass
    return out


def _cpu_delta(before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(total CPU seconds, CPU seconds of the busiest single process) between two snapshots."""
    deltas = [cpu - before.get(pid, 0.0) for pid, cpu in after.items()]
    return (sum(deltas), max(deltas)) if deltas else (float("nan"), float("nan"))


def _sequential_loop(batch: list[tuple[str, str]], fmt: str) -> dict:
    verify_one("Answer: $\\frac{1}{2}$", "0.5", fmt)  # the same warm-up the workers do
    latencies, statuses = [], []
    t0, c0 = time.perf_counter(), time.process_time()
    for response, gold in batch:
        t = time.perf_counter()
        statuses.append(verify_one(response, gold, fmt)[0])
        latencies.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "latencies": latencies, "statuses": statuses}


def _sequential_run(batch: list[dict], fmt: str) -> dict:
    """The plain ``verify_one`` loop, in a fresh process (cold caches, like the pool's workers)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(_sequential_loop, [(it["response"], it["gold"]) for it in batch], fmt).result()


def _pool_run(batch: list[dict], **scorer_kwargs) -> dict:
    """Score ``batch`` with a fresh, warmed-up scorer (cold parse caches, like a new step)."""
    t0 = time.perf_counter()
    with RewardScorer(**scorer_kwargs) as scorer:
        scorer.score(["Answer: 1"] * scorer.num_workers, ["1"] * scorer.num_workers)
        startup = time.perf_counter() - t0
        t0, c0 = time.perf_counter(), _tree_cpu()
        scores = scorer.score([it["response"] for it in batch], [it["gold"] for it in batch])
        wall = time.perf_counter() - t0
        cpu, busiest = _cpu_delta(c0, _tree_cpu())
        # What the wall time would be with the pool's cores to itself: the total CPU spread
        # over the workers' cores, unless one process (a worker or the parent) needs longer.
        idle_wall = max(cpu / scorer.num_workers, busiest)
        return {
            "scores": scores,
            "wall": wall,
            "cpu": cpu,
            "idle_wall": idle_wall,
            "startup": startup,
            "workers": scorer.num_workers,
        }


def _load_answers(data_dir: Path) -> list[str]:
    files = sorted(data_dir.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no *.jsonl files in {data_dir} (pass --data-dir)")
    answers = [str(json.loads(line)["answer"]) for f in files for line in f.open() if line.strip()]
    # The wrong forms (a + 1, 2a, a sqrt 2, ...) differ from a only for a nonzero integer.
    return [a for a in answers if a.lstrip("-").isdigit() and int(a) != 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / ".." / "shared" / "data" / "eval")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--patho", type=float, default=0.01, help="fraction of pathological inputs")
    ap.add_argument("--workers", type=int, default=None, help="pool size (default: CPU count)")
    ap.add_argument("--timeout", type=float, default=3.0, help="per-item timeout, seconds")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--answer-format", default="auto")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the best of each is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    items = build_items(_load_answers(args.data_dir), args.n, args.patho, args.seed)
    clean = [it for it in items if it["kind"] in ("correct", "wrong", "messy", "no_answer")]
    fmt = args.answer_format

    opts = {
        "answer_format": fmt,
        "num_workers": args.workers,
        "timeout": args.timeout,
        "chunk_size": args.chunk_size,
    }
    # Interleaved repeats, best wall time per mode: other jobs on a shared machine slow
    # whichever run they overlap, and the minimum is the least disturbed one.
    seqs, plains, dedups = [], [], []
    for _ in range(args.repeat):
        seqs.append(_sequential_run(clean, fmt))
        plains.append(_pool_run(clean, dedupe=False, **opts))  # pure parallelism: every item graded
        dedups.append(_pool_run(clean, dedupe=True, **opts))  # the default: distinct (answer, gold) once
    seq, plain, dedup = (min(runs, key=lambda r: r["wall"]) for runs in (seqs, plains, dedups))
    full = _pool_run(items, dedupe=True, **opts)  # with the pathological 1%
    seq_s, seq_cpu, seq_lat, seq_status = seq["wall"], seq["cpu"], seq["latencies"], seq["statuses"]
    workers = plain["workers"]

    runs = ((plain, clean), (dedup, clean), (full, items))
    lost = sum(len(batch) - len(run["scores"]) for run, batch in runs)
    wrong_vs_label = sum(
        s.status not in it["expected"] for run, batch in runs for s, it in zip(run["scores"], batch)
    )
    wrong_vs_seq = sum(s.status != q for run in (plain, dedup) for s, q in zip(run["scores"], seq_status))
    timed_out = [
        (s.extracted or it["response"], it["gold"])
        for s, it in zip(full["scores"], items)
        if s.status == "timeout"
    ]
    timeout_jobs = len(set(timed_out))  # identical (answer, gold) pairs are graded once
    budget_s = dedup["wall"] + timeout_jobs * args.timeout / workers
    statuses: dict[str, int] = {}
    for s in full["scores"]:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    pool_lat = [s.seconds for s in plain["scores"]]

    result = {
        "n_items": len(items),
        "n_clean": len(clean),
        "n_pathological": len(items) - len(clean),
        "workers": workers,
        "timeout_s": args.timeout,
        "chunk_size": args.chunk_size,
        "answer_format": fmt,
        "repeat": args.repeat,
        "pool_startup_s": plains[0]["startup"],
        "sequential_s": seq_s,
        "sequential_cpu_s": seq_cpu,
        "pool_nodedupe_clean_s": plain["wall"],
        "pool_nodedupe_clean_cpu_s": plain["cpu"],
        "speedup_nodedupe_clean": seq_s / plain["wall"],
        "projected_idle_speedup_nodedupe_clean": seq_cpu / plain["idle_wall"],
        "pool_clean_s": dedup["wall"],
        "pool_clean_cpu_s": dedup["cpu"],
        "speedup_clean": seq_s / dedup["wall"],
        "projected_idle_speedup_clean": seq_cpu / dedup["idle_wall"],
        "pool_all_s": full["wall"],
        "pool_all_budget_s": budget_s,
        "pool_all_excess_s": full["wall"] - budget_s,
        "n_timeout_items": len(timed_out),
        "n_timeout_jobs": timeout_jobs,
        "latency_sequential_p50_ms": 1e3 * _pct(seq_lat, 0.50),
        "latency_sequential_p99_ms": 1e3 * _pct(seq_lat, 0.99),
        "latency_pool_p50_ms": 1e3 * _pct(pool_lat, 0.50),
        "latency_pool_p99_ms": 1e3 * _pct(pool_lat, 0.99),
        "lost": lost,
        "wrong_vs_label": wrong_vs_label,
        "wrong_vs_sequential": wrong_vs_seq,
        "sequential_wrong_vs_label": sum(q not in it["expected"] for q, it in zip(seq_status, clean)),
        "status_counts_all": statuses,
        "mean_response_chars": statistics.mean(len(it["response"]) for it in clean),
        "load_average_1m_at_end": os.getloadavg()[0],
    }

    def speed(run: dict) -> str:
        wall, cpu, idle = run["wall"], run["cpu"], run["idle_wall"]
        return (
            f"{wall:.2f} s  {len(clean) / wall:.0f} items/s  {seq_s / wall:.2f}x  "
            f"(CPU {cpu:.2f} s; idle-cores projection {seq_cpu / idle:.2f}x)"
        )

    rows = [
        ("items (clean + pathological)", f"{len(clean)} + {len(items) - len(clean)}"),
        ("workers / timeout / chunk", f"{workers} / {args.timeout:g} s / {args.chunk_size}"),
        ("pool start-up (not timed below)", f"{plains[0]['startup']:.2f} s"),
        (
            "sequential verify_one, clean",
            f"{seq_s:.2f} s  {len(clean) / seq_s:.0f} items/s  1.00x  (CPU {seq_cpu:.2f} s)",
        ),
        ("pool, clean, no dedupe", speed(plain)),
        ("pool, clean (default)", speed(dedup)),
        (
            "pool, all (default)",
            f"{full['wall']:.2f} s  ({len(timed_out)} items / {timeout_jobs} jobs timed out)",
        ),
        (
            "  budget: clean + timeout jobs x timeout / workers",
            f"{budget_s:.2f} s  (excess {full['wall'] - budget_s:+.2f} s)",
        ),
        (
            "latency p50 / p99, sequential",
            f"{1e3 * _pct(seq_lat, 0.5):.2f} / {1e3 * _pct(seq_lat, 0.99):.2f} ms",
        ),
        (
            "latency p50 / p99, in worker (no dedupe)",
            f"{1e3 * _pct(pool_lat, 0.5):.2f} / {1e3 * _pct(pool_lat, 0.99):.2f} ms",
        ),
        ("lost", str(lost)),
        ("wrong (vs label / vs sequential)", f"{wrong_vs_label} / {wrong_vs_seq}"),
        ("statuses (all)", json.dumps(statuses, sort_keys=True)),
        ("load average (1 min) at end", f"{os.getloadavg()[0]:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if lost or wrong_vs_label or wrong_vs_seq:
        sys.exit(1)


if __name__ == "__main__":
    main()
