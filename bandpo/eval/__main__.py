"""``python -m bandpo.eval`` (what scripts/eval.sh runs): see ``bandpo.eval.cli``."""

from bandpo.eval.cli import main

if __name__ == "__main__":
    main()
