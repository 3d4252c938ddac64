"""`python -m calm_lightning <command>`: the project's one command line (calm_lightning/cli.py)."""

from calm_lightning.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
