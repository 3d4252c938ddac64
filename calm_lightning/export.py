"""`python -m calm_lightning.export run_dir=<run dir> out=<dir> [merge=true] [overwrite=false]
[dtype=auto]`: the entry point; the exported-model product lives in calm_lightning/exported/
(writer.py builds the folder)."""

from calm_lightning.exported.writer import main

if __name__ == "__main__":
    raise SystemExit(main())
