"""Benchmarks, profilers and checks of bandpo's parts, each run as ``python -m benchmarks.<name>``
from the repository root (docs/benchmarks.md has the results); ``common`` holds the actor
benchmarks' shared helpers. Not part of the installed package (pyproject's packages.find includes
bandpo only)."""
