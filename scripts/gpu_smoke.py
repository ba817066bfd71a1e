"""The GPU smoke test: ``python scripts/gpu_smoke.py [--cpu] ...`` runs ``python -m bandpo.tools.gpu_smoke``
(bandpo installed, or the repository root on PYTHONPATH; see that package for what it checks)."""

from bandpo.tools.gpu_smoke.cli import main

if __name__ == "__main__":
    main()
