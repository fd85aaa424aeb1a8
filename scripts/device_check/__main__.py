"""``python scripts/device_check OUT_DIR [--dry-run] [--only SECTIONS]``: see the package docstring."""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[1]
# Run as a folder, Python puts the package's own folder first on the path, where its section
# modules (`kernels`, ...) would shadow installed packages of those names. The checkout instead
# (runnable without a pip install; `tests.support`), and `scripts/` (this package, `bench_sim`).
if sys.path and Path(sys.path[0]).resolve() == PACKAGE_DIR:
    sys.path.pop(0)
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from device_check.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
