"""fedgate's release: what the cloud's service instances install (`make release`).

One wheel of fedgate's own code, without its dependencies: the instances' installer
(infra/terraform/modules/fedgate-service/files/fedgate-install.py) takes those from PyPI.
Beside it, the Spark job's jars that pyspark lacks (the ones `make setup` fetched from Maven
Central: the Kafka source, Iceberg, s3a, the catalog's JDBC drivers) as one tar.gz, so an
instance needs no Maven.  Run as `python -m infra.cloud.release <folder>`; prints both paths.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
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


def build_jars_archive(dest: Path, wheel: Path, jars_dir: Path) -> Path:
    """The Spark job's jars of `jars_dir` as fedgate-spark-jars-<the wheel's version>.tar.gz
    in `dest`: .jar files at its top, nothing else."""
    jars = sorted(jars_dir.glob("*.jar"))
    if not jars:
        raise ReleaseError(f"no jars in {jars_dir}: run `make setup` (it fetches them)")
    version = wheel.name.split("-")[1]
    archive = dest / f"fedgate-spark-jars-{version}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for jar in jars:
            tar.add(jar, arcname=jar.name)
    return archive


def build_release(dest: Path) -> tuple[Path, Path]:
    """The wheel and the jars archive in `dest`."""
    from spark.settings import default_jars_dir

    wheel = build_wheel(dest)
    return wheel, build_jars_archive(dest, wheel, Path(default_jars_dir()))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m infra.cloud.release <folder>", file=sys.stderr)
        return 2
    try:
        for path in build_release(Path(args[0])):
            print(path)
    except ReleaseError as e:
        print(f"fedgate: release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
