"""What a benchmark records about the machine and the code it ran on, in one place for every bench."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "version"]

ROOT = Path(__file__).resolve().parent.parent


def version(dist: str) -> str:
    """The installed version of a distribution, or "absent"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def machine_info(packages: Sequence[str] = (), *, torch: bool = False, commit: bool = True) -> dict[str, Any]:
    """CPU, platform, the versions of `packages`, torch's threads when `torch`, the commit, date and load."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    if torch:
        import torch as _torch

        info.update(torch=_torch.__version__, torch_threads=_torch.get_num_threads(), cuda=_torch.cuda.is_available())
    info.update({name.replace("-", "_"): version(name) for name in packages})
    if commit:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        info["commit"] = done.stdout.strip()
    info["date_utc"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    info["loadavg_at_start"] = list(os.getloadavg())
    return info
