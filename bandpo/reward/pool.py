"""Parallel grading in worker processes with a hard per-item timeout.

Why pebble (``pebble.ProcessPool``) rather than the standard library or our own pool:

- ``schedule(fn, args, timeout=t)`` starts the clock when a worker *picks the task up*
  (not when it is queued), kills that worker on expiry and starts a replacement; the
  future fails with ``TimeoutError`` and every other task goes on. A worker that dies
  (segfault, OOM killer, ``kill -9``) fails only its own task, with ``ProcessExpired``.
- ``concurrent.futures.ProcessPoolExecutor`` has no per-task timeout, and one dead worker
  breaks the whole executor; ``multiprocessing.Pool`` cannot kill a running task and
  waits forever for a task whose worker died. A hand-written pool (one pipe per worker, a
  select loop, kill on deadline) is about 200 lines of subtle code that pebble, a
  maintained library, already gets right.

Two pebble behaviours are handled here:

- On timeout pebble sends SIGTERM, waits up to 3 s, then SIGKILLs. Its SIGTERM handler is
  Python code, which cannot run while sympy is stuck inside one C call (a huge integer
  power), so every such timeout would cost 3 s extra. Workers restore the default SIGTERM
  action, which ends the process at once.
- A worker that dies while no task is running marks the whole pool broken and fails every
  queued task. The scorer checks the pool before each task, rebuilds it when needed and
  resubmits what was lost. A job is reported as ``error`` after ``MAX_CRASHES`` runs whose
  worker died under it, or after being lost ``MAX_LOST`` times with a broken or wedged pool
  (not its fault, so a more generous limit; it only bounds the retries).
- A worker killed from outside while it holds the pool's channel lock (taking a task or
  sending a result) leaves that lock held for pebble's 60 s lock timeout: no worker can
  take a task and no timeout can fire (pebble stops a worker only under that lock). A
  watchdog rebuilds the pool when no task has started or finished for
  ``timeout + STALL_GRACE_S`` seconds (a healthy pool starts or finishes one at least
  every ``timeout`` plus a worker restart) and reruns what was in flight, so ``score``
  cannot hang either.

How a batch is split into jobs (all in the parent, all cheap string work):

- The answer is extracted first. Without one, ``dapo``/``boxed`` items are ``no_answer``
  at once; ``auto`` items need math-verify's extraction over the whole response.
- The grade of an extracted answer depends only on (answer, gold) (``verify_extracted``),
  so each distinct pair is graded once: a prompt's n samples repeat a few answers.
- Pairs whose answer and gold are short and free of what makes sympy work for long
  (powers, factorials, binomials, huge literals: ``_is_simple``) share one task per gold
  (split beyond ``chunk_size`` pairs): one worker parses that gold and the answers its
  samples repeat once (LaTeX parses, not IPC, dominate the cost; a gold split over two
  workers is parsed twice), and the parent pays pebble's ~0.2 ms per task rarely. A
  chunk's timeout is the per-item one (simple pairs take milliseconds); if a chunk fails
  anyway its pairs are rerun one task each, so a grade never depends on its neighbours
  and a wrongly trusted pair costs one extra timeout at most.
- Everything else gets its own task and its own timeout.

Workers start with the ``forkserver`` method (``spawn`` where that is unavailable): the
trainer process holds torch/Ray threads, and forking it is unsafe. The fork server
preloads ``bandpo.reward.warm`` (the grader with its LaTeX parser initialised), so a
replacement worker starts in milliseconds instead of re-importing sympy (~1 s), and
``bandpo.reward.clean_main``, so workers do not import the program's ``__main__`` (which
fails from ``python - <script`` and would rerun an unguarded entry script): ``score_batch``
works from scripts on standard input, ``python -c`` and notebooks alike. (If some other code
started this process's fork server first, its preloads are not ours and workers import
``__main__`` as with ``spawn``.)

Infrastructure faults are not grades. Before its first pool, and again when pools keep
breaking within one batch with no task finishing (``MAX_REBUILDS``), the scorer starts one
worker by hand that runs the workers' start-up and grades a known answer; if that fails,
``score`` raises ``VerifierUnavailable`` with the worker's traceback (or exit code) instead
of returning a batch of ``error`` items. A response that crashes its worker is still that
item's ``error``: the pool replaces the worker and goes on.

Each worker caps its own address space (``memory_cap_gib``, RLIMIT_AS): model output built
to make sympy allocate without bound (``2^{2^{29}}`` takes ~410 MiB to grade) gets MemoryError in
that worker instead of taking the node's memory: math-verify treats it as a failed comparison
(the item is ``incorrect``), or the worker dies and the item ends ``error``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.process
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Self

from pebble import ProcessExpired, ProcessPool

from bandpo.errors import VerifierUnavailable, check_choice
from bandpo.reward.checks import check_error_share, check_memory_cap, check_verifier_workers
from bandpo.reward.extract import ANSWER_FORMATS, extract_answer, normalize_gold
from bandpo.reward.pool_health import DEFAULT_MEMORY_CAP_GIB, check_workers_start, init_worker
from bandpo.reward.scheme import RewardScheme, Score, check_score_inputs
from bandpo.reward.verify import gold_text, verify_extracted, verify_one

__all__ = ["RewardScorer", "VerifierUnavailable", "check_error_share", "score_batch"]

MAX_CRASHES = 2
MAX_LOST = 4
STALL_GRACE_S = 10.0
WATCH_EVERY_S = 0.5
STOP_WAIT_S = 10.0
MAX_REBUILDS = 3  # pool rebuilds in one batch with no task finished before the start-up check reruns
CLEAN_MAIN_ENV = "BANDPO_REWARD_POOL_MAIN"  # read by bandpo.reward.clean_main (never imported here)


# What a "simple" answer may contain (see ``_is_simple``): a few LaTeX commands that cannot
# blow up, then only digits, single letters and arithmetic that does not grow numbers.
_TEXT_GROUP_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{[^{}]*\}")  # units, words: never evaluated
_SIMPLE_COMMANDS_RE = re.compile(r"\\(?:[dt]?frac|sqrt|pi|left|right|cdot|times|circ|%|,|!|;| )")
_SIMPLE_CHARS_RE = re.compile(r"[0-9A-Za-z\s{}()\[\].,;:+\-/=<>$%|]*")
_LETTER_RUN_RE = re.compile(r"[A-Za-z]{2}")
_LONG_DIGITS_RE = re.compile(r"\d{13}")

_Grade = tuple[str, "str | None", float]  # (status, extracted, seconds spent grading)
_Job = tuple[str, str, str]  # ("answer", extracted, gold) or ("response", response, gold)


def _grade_jobs(jobs: list[_Job], answer_format: str) -> list[_Grade]:
    """Worker side: grade each job, timing it."""
    out = []
    for kind, text, gold in jobs:
        start = time.perf_counter()
        if kind == "answer":
            status, extracted = verify_extracted(text, gold), text
        else:
            status, extracted = verify_one(text, gold, answer_format)
        out.append((status, extracted, time.perf_counter() - start))
    return out


def _is_simple(answer: str) -> bool:
    """A short answer with no operator that can make sympy work for long.

    Power towers, factorials, binomials and huge literals are what hang sympy; a string of
    at most 48 characters built from digits (runs of at most 12), single-letter symbols,
    ``+ - / =``, brackets, ``\\frac``/``\\sqrt``/``\\pi`` and ``\\text{...}`` has none of them.
    """
    if len(answer) > 48 or _LONG_DIGITS_RE.search(answer):
        return False
    rest = _SIMPLE_COMMANDS_RE.sub(" ", _TEXT_GROUP_RE.sub(" ", answer))
    return bool(_SIMPLE_CHARS_RE.fullmatch(rest)) and not _LETTER_RUN_RE.search(rest)


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _mp_context(start_method: str | None):
    methods = multiprocessing.get_all_start_methods()
    method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        # Only takes effect if no fork server runs yet. The fork server inherits the
        # environment at its start: describe the main module the way a worker checks it
        # (multiprocessing.spawn.get_preparation_data) for bandpo.reward.clean_main.
        main = sys.modules.get("__main__")
        name = getattr(getattr(main, "__spec__", None), "name", None)
        path = getattr(main, "__file__", None)
        if path is not None and not os.path.isabs(path) and multiprocessing.process.ORIGINAL_DIR is not None:
            path = os.path.join(multiprocessing.process.ORIGINAL_DIR, path)
        os.environ[CLEAN_MAIN_ENV] = json.dumps(
            {"name": name, "path": os.path.normpath(path) if path else None}
        )
        ctx.set_forkserver_preload(["bandpo.reward.clean_main", "bandpo.reward.warm"])
    return ctx


class RewardScorer:
    """Grades batches of responses in a persistent pool of worker processes.

    Create it once and reuse it across training steps (workers stay warm); close it with
    ``close()`` or use it as a context manager. ``score`` is not thread-safe.

    Args:
        scheme: how statuses become rewards (default ``RewardScheme()``: +1 / -1).
        answer_format: ``dapo`` | ``boxed`` | ``auto`` (see ``bandpo.reward.extract``).
        num_workers: worker processes; default: the CPUs this process may run on.
        timeout: hard limit in seconds for grading one item, enforced by killing its worker.
        chunk_size: most simple (answer, gold) pairs per task; 1 disables chunking.
        dedupe: grade each distinct (extracted answer, gold) pair once per batch.
        start_method: multiprocessing start method; default ``forkserver`` (else ``spawn``).
        memory_cap_gib: address-space limit of each worker (GiB); None for none.
        log_path: file for the workers' output (appended); None: this process's stderr.
    """

    def __init__(
        self,
        scheme: RewardScheme | None = None,
        answer_format: str = "auto",
        num_workers: int | None = None,
        timeout: float = 5.0,
        *,
        chunk_size: int = 64,
        dedupe: bool = True,
        start_method: str | None = None,
        memory_cap_gib: float | None = DEFAULT_MEMORY_CAP_GIB,
        log_path: str | os.PathLike | None = None,
    ):
        check_choice(answer_format, ANSWER_FORMATS, "answer_format")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        check_verifier_workers(num_workers)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        check_memory_cap(memory_cap_gib)
        self.scheme = scheme if scheme is not None else RewardScheme()
        self.answer_format = answer_format
        self.num_workers = num_workers or _default_workers()
        self.timeout = float(timeout)
        self.chunk_size = chunk_size
        self.dedupe = dedupe
        self.memory_cap_bytes = int(memory_cap_gib * 2**30) if memory_cap_gib else None
        self.log_path = str(log_path) if log_path is not None else None
        self._ctx = _mp_context(start_method)
        self._pool: ProcessPool | None = None
        self._closed = False
        self._checked = False  # the start-up check passed
        self._rebuilds = 0  # pools built since a task last finished

    def score(
        self,
        responses: Sequence,
        answers: Sequence,
        response_lengths: Sequence[int] | None = None,
    ) -> list[Score]:
        """Grade ``responses[i]`` against ``answers[i]``; one ``Score`` per item, in order.

        Item failures never raise: a hang becomes ``timeout``, a crashed worker is
        retried and then ``error``, a non-string response or a missing gold answer is
        ``invalid_input``. ``response_lengths`` (tokens) are required when the scheme
        does overlong shaping. Raises ValueError when the sequences' lengths differ,
        RuntimeError after ``close()`` and ``VerifierUnavailable`` when workers cannot start.
        """
        check_score_inputs(self.scheme, responses, answers, response_lengths)
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        grades = _BatchRun(self, responses, answers).run()
        scores = []
        for i, (status, extracted, seconds) in enumerate(grades):
            length = None if response_lengths is None else int(response_lengths[i])
            scores.append(
                Score(
                    reward=self.scheme.reward(status, length),
                    status=status,
                    extracted=extracted,
                    correct=status == "correct",
                    seconds=seconds,
                )
            )
        return scores

    def close(self) -> None:
        """Stop the workers. The scorer cannot be used afterwards."""
        self._discard_pool()
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ensure_pool(self) -> ProcessPool:
        if self._closed:  # a score() still running in another thread when close() was called
            raise RuntimeError("RewardScorer is closed")
        if self._pool is None or not self._pool.active:
            self._discard_pool()
            self._rebuilds += 1
            if not self._checked or self._rebuilds > MAX_REBUILDS:
                # Raises VerifierUnavailable (with the worker's cause) when workers cannot start.
                check_workers_start(self._ctx, self.memory_cap_bytes, self.log_path)
                self._checked, self._rebuilds = True, 0
            self._pool = ProcessPool(
                max_workers=self.num_workers,
                initializer=init_worker,
                initargs=(self.memory_cap_bytes, self.log_path),
                context=self._ctx,
            )
        return self._pool

    def _discard_pool(self) -> None:
        """Stop the pool's workers; give up waiting after ``STOP_WAIT_S`` rather than hang."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        stopper = threading.Thread(target=_stop_pool, args=(pool,), daemon=True)
        stopper.start()
        stopper.join(timeout=STOP_WAIT_S)
        if stopper.is_alive():
            logging.getLogger(__name__).warning("reward pool did not stop in %.0f s; abandoned", STOP_WAIT_S)


def _stop_pool(pool: ProcessPool) -> None:
    try:
        pool.stop()
        pool.join()
    except Exception:  # a broken pool may fail to stop cleanly; its workers are gone anyway
        logging.getLogger(__name__).debug("stopping the reward pool failed", exc_info=True)


class _BatchRun:
    """One ``score`` call: jobs, the items each job resolves, tasks in flight, retries."""

    def __init__(self, scorer: RewardScorer, responses: Sequence, answers: Sequence):
        self.scorer = scorer
        n = len(responses)
        self.grades: list[_Grade | None] = [None] * n
        self.jobs: list[_Job] = []
        self.job_items: list[list[int]] = []  # the items each job's grade goes to
        self.crashes: list[int] = []  # runs of each job whose worker died under it
        self.lost: list[int] = []  # runs of each job lost with a broken or wedged pool
        self.simple_jobs: dict[str, list[int]] = {}  # gold -> simple answer jobs
        self.single_jobs: list[int] = []
        seen: dict[_Job, int] = {}
        for i in range(n):
            self._plan(i, responses[i], answers[i], seen)
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight: dict[Future, list[int]] = {}  # future -> its job ids
        self.seen_running: set[Future] = set()  # in-flight futures a worker has taken
        # Bumped when a wedged pool is thrown away: late callbacks of its futures are ignored.
        self.generation = 0
        self.lost_with_pool = 0  # tasks whose pool broke under them (rerun)

    def _plan(self, i: int, response: object, answer: object, seen: dict[_Job, int]) -> None:
        """Grade item ``i`` at once if that is free, else attach it to a (shared) job."""
        fmt = self.scorer.answer_format
        gold = gold_text(answer)
        if not isinstance(response, str) or gold is None:
            self.grades[i] = ("invalid_input", None, 0.0)
            return
        try:
            extracted = extract_answer(response, fmt)
        except Exception:  # what verify_one reports for it too
            logging.getLogger(__name__).debug("extract_answer failed", exc_info=True)
            self.grades[i] = ("error", None, 0.0)
            return
        if extracted is None and fmt != "auto":
            self.grades[i] = ("no_answer", None, 0.0)
            return
        if extracted is None:
            job, simple = ("response", response, gold), False
        else:
            job = ("answer", extracted, gold)
            simple = _is_simple(extracted) and _is_simple(normalize_gold(gold))
        if self.scorer.dedupe and job in seen:
            self.job_items[seen[job]].append(i)
            return
        seen[job] = len(self.jobs)
        self.jobs.append(job)
        self.job_items.append([i])
        self.crashes.append(0)
        self.lost.append(0)
        if simple:
            self.simple_jobs.setdefault(gold, []).append(len(self.jobs) - 1)
        else:
            self.single_jobs.append(len(self.jobs) - 1)

    def run(self) -> list[_Grade]:
        """Submit every job, collect the outcomes; one grade per item, in order."""
        size = self.scorer.chunk_size
        for group in self.simple_jobs.values():
            for k in range(0, len(group), size):
                self._submit(group[k : k + size])
        for j in self.single_jobs:
            self._submit([j])
        stall_limit = self.scorer.timeout + STALL_GRACE_S
        last_progress = time.monotonic()
        while self.in_flight:
            try:
                future, task, generation = self.done.get(timeout=WATCH_EVERY_S)
            except queue.Empty:
                if self._a_task_started():
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > stall_limit:
                    self._restart_wedged_pool()
                    last_progress = time.monotonic()
                continue
            if generation != self.generation:
                continue
            del self.in_flight[future]
            self.seen_running.discard(future)
            last_progress = time.monotonic()
            self._collect(future, task)
        if self.lost_with_pool:
            logging.getLogger(__name__).warning(
                "the reward pool broke (a worker died); %d tasks were rerun", self.lost_with_pool
            )
        return [g if g is not None else ("error", None, 0.0) for g in self.grades]

    def _submit(self, task: list[int]) -> None:
        """Schedule one task (job ids), rebuilding a broken pool once; else give up on it."""
        spent = [j for j in task if self.crashes[j] >= MAX_CRASHES or self.lost[j] >= MAX_LOST]
        self._settle(spent, "error", 0.0)
        task = [j for j in task if j not in spent]
        if not task:
            return
        payload = [self.jobs[j] for j in task]
        for _ in range(2):
            try:
                future = self.scorer._ensure_pool().schedule(
                    _grade_jobs, args=(payload, self.scorer.answer_format), timeout=self.scorer.timeout
                )
            except VerifierUnavailable:
                raise
            except RuntimeError:  # "The Pool is not active" / "Unexpected error within the Pool"
                self.scorer._discard_pool()
                continue
            self.in_flight[future] = task
            future.add_done_callback(lambda f, t=task, g=self.generation: self.done.put((f, t, g)))
            return
        self._settle(task, "error", 0.0)

    def _collect(self, future: Future, task: list[int]) -> None:
        chunked = len(task) > 1
        try:
            results = future.result()
        except TimeoutError:
            if chunked:  # which job hung is unknown: give each its own task and timeout
                self._resubmit_singly(task)
            else:
                self._settle(task, "timeout", self.scorer.timeout)
            return
        except ProcessExpired:  # the worker died; a chunk's jobs are not to blame yet
            self._resubmit_singly(task, self.crashes if not chunked else None)
            return
        except Exception:  # the pool broke (BrokenProcessPool) or was stopped (CancelledError)
            # Not discarded here: other failing futures of the same pool would then throw away
            # its replacement too. ``_ensure_pool`` sees that a broken pool is inactive.
            logging.getLogger(__name__).debug("reward task lost with its pool", exc_info=True)
            self.lost_with_pool += 1
            # pebble breaks the pool only when no task was running: none of these is to blame.
            self._resubmit_singly(task, self.lost)
            return
        self.scorer._rebuilds = 0  # a task finished: the pool works
        for j, grade in zip(task, results):
            for i in self.job_items[j]:
                self.grades[i] = grade

    def _a_task_started(self) -> bool:
        """Whether a worker took an in-flight task since the last look (pebble's ack)."""
        started = [f for f in self.in_flight if f.running() and f not in self.seen_running]
        self.seen_running.update(started)
        return bool(started)

    def _restart_wedged_pool(self) -> None:
        """Nothing started or finished for a full timeout plus grace: replace the pool, rerun."""
        logging.getLogger(__name__).warning("reward pool made no progress; replacing it")
        self.scorer._discard_pool()
        self.generation += 1
        stranded = [j for task in self.in_flight.values() for j in task]
        self.in_flight.clear()
        self.seen_running.clear()
        self._resubmit_singly(stranded, self.lost)

    def _resubmit_singly(self, task: list[int], blame: list[int] | None = None) -> None:
        """Rerun each job of ``task`` as its own task, first counting the run in ``blame``."""
        for j in task:
            if blame is not None:
                blame[j] += 1
            self._submit([j])

    def _settle(self, task: list[int], status: str, seconds: float) -> None:
        """Give a job's items a grade the workers did not produce (timeout, error)."""
        for j in task:
            kind, text, _ = self.jobs[j]
            extracted = text if kind == "answer" else None
            for i in self.job_items[j]:
                self.grades[i] = (status, extracted, seconds)


def score_batch(
    responses: Sequence,
    answers: Sequence,
    *,
    scheme: RewardScheme | None = None,
    answer_format: str = "auto",
    num_workers: int | None = None,
    timeout: float = 5.0,
    response_lengths: Sequence[int] | None = None,
    memory_cap_gib: float | None = DEFAULT_MEMORY_CAP_GIB,
) -> list[Score]:
    """One-shot ``RewardScorer(...).score(...)``: starts and stops a pool for this batch.

    Use a long-lived ``RewardScorer`` in a training loop to keep the workers warm.
    """
    with RewardScorer(scheme, answer_format, num_workers, timeout, memory_cap_gib=memory_cap_gib) as scorer:
        return scorer.score(responses, answers, response_lengths)
