"""``python -m bandpo.tools.gpu_smoke [--cpu] [--out FILE] ...`` (see ``bandpo.tools.gpu_smoke.cli``)."""

from bandpo.tools.gpu_smoke.cli import main

if __name__ == "__main__":
    main()
