"""The byte parsers of the wire contract and the client, fuzzed: each fails only as it documents.

The targets live in `tests/fuzz_parsers.py` (what each one asserts is said
there). Here hypothesis drives every target with arbitrary bytes, and with
the valid seeds damaged, in the default suite; and when atheris is
installed, a bounded coverage-guided run drives them all through
`fuzz_one` in a child process, which must end without a crash. The
defects these found are pinned by name below.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import fuzz_parsers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheclient.checkpoint.layout import CheckpointCorrupt, parse_manifest
from cacheclient.prefetch import ModelManifest, ParameterValueError
from cacheclient.wire import codec, object_name

HARNESS = Path(__file__).with_name("fuzz_parsers.py")
ATHERIS_RUNS = 20_000

_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.mark.parametrize("target", fuzz_parsers.TARGETS, ids=lambda t: t.__name__.removeprefix("target_"))
@_SETTINGS
@given(data=st.binary(max_size=600))
def test_parser_takes_any_bytes(target: fuzz_parsers.Target, data: bytes) -> None:
    target(data)


@_SETTINGS
@given(seed=st.sampled_from(fuzz_parsers._seeds()), at=st.integers(0, 1 << 16), flip=st.integers(1, 255))
def test_damaged_seeds(seed: bytes, at: int, flip: int) -> None:
    """Valid inputs with one byte changed: the paths past the magic numbers and checksums."""
    fuzz_parsers.fuzz_one(seed)
    i = 1 + at % max(1, len(seed) - 1)
    if i < len(seed):
        fuzz_parsers.fuzz_one(seed[:i] + bytes([seed[i] ^ flip]) + seed[i + 1 :])


def test_defects_found_by_fuzzing_stay_fixed() -> None:
    # A field number 0 passed parse_chunk's walk and protobuf's DecodeError escaped.
    with pytest.raises(codec.StreamError, match="does not parse"):
        codec.parse_chunk(b"\x00\x00")
    # A manifest that is JSON but not an object, or nested past the recursion limit, raised
    # AttributeError / RecursionError instead of the parser's documented error.
    for raw in (b"[1]", b"7", b"[" * 100_000):
        with pytest.raises(ParameterValueError):
            ModelManifest.from_json(raw, "model")
        with pytest.raises(CheckpointCorrupt):
            parse_manifest("run/1", raw)
    # Keys with empty, "." or ".." path segments were S3 object names as is: SeaweedFS refused
    # them (the server answered INTERNAL) and file-backed S3 servers fold them into other names.
    for key in (b".", b"..", b"a//b", b"../../etc/passwd", b"dir/", b".\\"):
        assert object_name("p/", key).startswith("p/~b64/"), key
    assert object_name("p/", b"a/b.c/d") == "p/a/b.c/d"


@pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None, reason="atheris is not installed (pip install atheris)"
)
def test_atheris_run_finds_no_crash(tmp_path: Path) -> None:
    """A bounded coverage-guided run: libFuzzer exits 0 only when no input raised or failed an assertion."""
    result = subprocess.run(
        [sys.executable, str(HARNESS), f"-runs={ATHERIS_RUNS}", "-rss_limit_mb=4096", f"-artifact_prefix={tmp_path}/"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Done {ATHERIS_RUNS} runs" in result.stderr, result.stderr[-2000:]
