"""Terraform in one root module's folder, through python-terraform; failures are CloudErrors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from python_terraform import IsFlagged, Terraform

from infra.cloud.errors import CloudError
from infra.cloud.toolchain import Toolchain

PLAN_FILE = "tfplan"
#: How long a plan or an apply waits for the state's lock that another operator's run holds
#: (remote state) before it gives up, instead of failing at once
LOCK_TIMEOUT = "60s"


class TerraformRun:
    """init, plan, apply the saved plan, output: the steps of `gateway add` and `remove`."""

    def __init__(self, tf: Terraform):
        self.tf = tf

    @staticmethod
    def _check(
        what: str, result: tuple[int, str | None, str | None], ok: tuple[int, ...] = (0,)
    ) -> tuple[int, str]:
        code, out, err = result
        if code not in ok:
            detail = (err or out or "").strip()
            raise CloudError(f"terraform {what} failed (exit {code}):\n{detail}")
        return code, out or ""

    def init(self, backend_config: str | None = None) -> None:
        """`backend_config`: a partial backend configuration file (remote state), else none."""
        self._check(
            "init",
            self.tf.cmd(
                "init", input=False, no_color=IsFlagged, upgrade=IsFlagged, backend_config=backend_config
            ),
        )

    def plan(self, *, destroy: bool = False) -> tuple[bool, str]:
        """(has changes, plan text). Exit code 2 of -detailed-exitcode means changes."""
        code, out = self._check(
            "plan",
            self.tf.plan(
                out=PLAN_FILE,
                destroy=IsFlagged if destroy else None,
                input=False,
                no_color=IsFlagged,
                lock_timeout=LOCK_TIMEOUT,
            ),
            ok=(0, 2),
        )
        return code == 2, out

    def apply_plan(self) -> None:
        self._check(
            "apply",
            self.tf.apply(
                PLAN_FILE, skip_plan=True, input=False, no_color=IsFlagged, lock_timeout=LOCK_TIMEOUT
            ),
        )

    def output(self) -> dict[str, Any] | None:
        out: dict[str, Any] | None = self.tf.output()
        return out


@contextlib.contextmanager
def terraform_in(folder: Path, toolchain: Toolchain) -> Iterator[TerraformRun]:
    """python-terraform in `folder`, with our CLI config in its environment."""
    env = toolchain.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        tf = Terraform(working_dir=str(folder), terraform_bin_path=str(toolchain.terraform))
        tf.variables = None  # the root module and its tfvars files hold the inputs; no -var-file
        yield TerraformRun(tf)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
