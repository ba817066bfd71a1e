"""Evaluation: metrics over n samples (mean@n, pass@k, maj@n), the evaluation run, checkpoint targets, the CLI."""
