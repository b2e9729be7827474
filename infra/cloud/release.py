"""fedgate's release: the wheel the cloud's service instances install (`make release`).

One wheel of fedgate's own code, without its dependencies: the instances' installer
(infra/terraform/modules/fedgate-service/files/fedgate-install.py) takes those from PyPI.
Run as `python -m infra.cloud.release <folder>`; prints the wheel's path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from backend.errors import FedgateError
from infra.local.settings import PROJECT_ROOT


class ReleaseError(FedgateError):
    """The wheel could not be built; the message carries pip's words."""


def build_wheel(dest: Path) -> Path:
    """Build fedgate's wheel into `dest` (emptied first); its path."""
    shutil.rmtree(dest, ignore_errors=True)
    # setuptools builds in the tree: a build/lib of an older tree would put files that are
    # gone from the sources into the wheel
    shutil.rmtree(PROJECT_ROOT / "build" / "lib", ignore_errors=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(dest),
            str(PROJECT_ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = sorted(dest.glob("fedgate-*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ReleaseError(f"building fedgate's wheel: {(done.stderr or done.stdout)[-2000:]}")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m infra.cloud.release <folder>", file=sys.stderr)
        return 2
    try:
        print(build_wheel(Path(args[0])))
    except ReleaseError as e:
        print(f"fedgate: release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
