"""Offline checkpoint resharding: see core.py (what it does) and tensor_plan.py (what depends on the layout)."""

from megacli.reshard.core import Result, find_source, reshard, verify  # noqa: F401
from megacli.reshard.verification import VerifyReport  # noqa: F401
