"""The Megatron-LM checkout the by-hand megatron_lm_*_check.py scripts (and
tests/test_megatron_lm_checkout.py) run: its release, which must be the installed Megatron-Core's."""

from __future__ import annotations

import re
from pathlib import Path

# The Megatron-LM tags megacli is checked against, by Megatron-Core minor release (one per Python:
# 0.16 on Python 3.11, 0.19 on Python 3.12).
TAGS = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}


def checkout_release(checkout: str | Path) -> str:
    """The checkout's release from megatron/core/package_info.py ("0.19.1"); a SystemExit saying
    which tag to use unless it is the installed Megatron-Core's minor release and one of TAGS."""
    from importlib.metadata import version

    info = (Path(checkout) / "megatron" / "core" / "package_info.py").read_text()
    release = ".".join(re.search(rf"^{k} = (\d+)", info, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
    installed = ".".join(version("megatron-core").split(".")[:2])
    if installed not in TAGS:
        raise SystemExit(f"the installed Megatron-Core is {version('megatron-core')}; the checks run with "
                         f"{' or '.join(f'Megatron-Core {m}' for m in TAGS)}")
    if release.rsplit(".", 1)[0] != installed:
        raise SystemExit(f"{checkout} is Megatron-LM {release}; this Python's Megatron-Core is "
                         f"{version('megatron-core')}: use a {TAGS[installed]} checkout with it")
    return release
