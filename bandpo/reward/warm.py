"""Import-time warm-up of the grader, for the reward pool's fork server.

The fork server only imports modules (``set_forkserver_preload``), so the warm-up is this
module's import side effect. Every worker then forks from a process in which sympy,
math-verify and the ANTLR LaTeX parser are already loaded and initialised: a worker
start costs milliseconds instead of ~0.3 s of parser set-up, which matters because every
timeout replaces a worker.
"""

import gc

from bandpo.reward.verify import verify_one

verify_one("Answer: $\\frac{1}{2}$", "0.5", "auto")

# Move everything loaded so far out of the collector's reach: forked workers then neither
# rescan sympy's module objects in every full collection nor copy their pages on write.
gc.freeze()
