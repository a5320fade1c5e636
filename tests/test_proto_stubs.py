"""The checked-in protobuf stubs match what `make proto` generates from proto/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_checked_in_stubs_are_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_client_package_never_imports_cachesvc() -> None:
    # A fresh interpreter importing the whole client must not pull in the server package.
    code = (
        "import sys, cacheclient, cacheclient.client, cacheclient.errors; "
        "print(sorted(m for m in sys.modules if m == 'cachesvc' or m.startswith('cachesvc.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    for path in (ROOT / "client" / "cacheclient").rglob("*.py"):
        text = path.read_text()
        assert "import cachesvc" not in text and "from cachesvc" not in text, path
