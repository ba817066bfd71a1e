"""The algorithm comparison on a recipe: ``compare.sh`` trains each algorithm x seed through
scripts/train.sh, ``report`` (with ``runs`` and ``tables``) writes the report and its figure;
``entropy.sh`` is the tiny recipe's entropy comparison. The reports here (results-entropy,
results-offpolicy, results-staleness) are its studies on tiny_arith."""
