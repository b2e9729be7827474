"""The job packaged for spark-submit: the zip holds what the driver imports, and the job's
resource files are found inside it."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from spark import package


def test_the_package_holds_the_jobs_code_and_resources(tmp_path):
    archive, main = package.build(tmp_path)
    names = set(zipfile.ZipFile(archive).namelist())
    assert {"spark/job.py", "spark/session.py", "backend/contract.py", "backend/settings_layers.py"} <= names
    assert {"spark/log4j2.properties", "spark/fairscheduler.xml"} <= names
    assert not any(n.startswith("tests/") or n.endswith(".pyc") for n in names)
    assert "from spark.job import main" in main.read_text()


def test_the_packaged_session_finds_its_resource_files_inside_the_zip(tmp_path):
    archive, _ = package.build(tmp_path)
    probe = (
        f"import sys; sys.path.insert(0, {str(archive)!r}); import spark.session as s; "
        "assert s.__file__.startswith(sys.path[0]), s.__file__; "
        "print(s.resource('fairscheduler.xml').read_text())"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert '<pool name="aggregates">' in done.stdout
