"""Each engine's release is written once, in the pom `make setup` resolves it with: the
settings' default, `fedgate --version` and setup.sh all read it from there."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from infra import releases
from infra.local.settings import LocalSettings

ROOT = Path(__file__).resolve().parents[2]


def test_kafkas_release_is_the_poms_for_the_settings_and_for_setup():
    assert re.fullmatch(r"\d+\.\d+\.\d+", releases.KAFKA_RELEASE)
    defaults = {f.name: f.default for f in dataclasses.fields(LocalSettings)}
    assert defaults["kafka_version"] == releases.KAFKA_RELEASE
    # setup.sh's own line, run as setup.sh runs it
    line = next(
        ln
        for ln in (ROOT / "infra/setup/setup.sh").read_text().splitlines()
        if ln.startswith("KAFKA_VERSION=")
    )
    out = subprocess.run(
        ["bash", "-c", f'{line}; printf %s "$KAFKA_VERSION"'],
        env={"ROOT": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    assert out.stdout == releases.KAFKA_RELEASE


def test_a_property_the_pom_lacks_is_an_error_naming_it():
    assert re.fullmatch(r"\d+\.\d+\.\d+", releases.ICEBERG_RELEASE)
    with pytest.raises(LookupError, match="no <kafka.versions> property"):
        releases.pom_property("kafka-pom.xml", "kafka.versions")
