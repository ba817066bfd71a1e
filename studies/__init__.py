"""The studies: experiments run with bandpo, each with its code, records, report and figures.

Not part of the installed package (pyproject's packages.find includes bandpo only): they import from
the repository root, as ``python -m studies.entropy.stage2`` there or through pytest (pythonpath ".").
"""
