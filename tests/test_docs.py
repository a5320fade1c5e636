"""The docs run: every ```python and ```sh block of README.md, docs/ and examples/, as written, against real servers.

A module fixture starts what `cachesvc up` would: a three-node metadata
shard, two cache servers registered with it (L1, L2, the tests' SeaweedFS
behind them under a prefix of their own, metrics on), and sample objects
under the prefixes the README reads. Each block then runs in a process of its own (a
Python block with the venv's interpreter, or the vLLM venv's when it imports vllm, a shell block under `bash -e -o
pipefail`) from a scratch directory that has the repository's examples/
beside it; the README's default addresses (cache 127.0.0.1:7070 and 7071,
metadata 7080-7082, metrics 7170) and bucket (`s3://cachesvc/`) are
replaced by the ones the fixture picked, and cachectl's defaults point at
them too. A block that cannot run
here says why in a `<!-- not-run: REASON -->` line right before it; `toml`
blocks must load as cache-server config.

Two pages are held to the code: docs/configuration.md names every key of
the config dataclasses with its default and variable (its tables are
generated: `python tests/test_docs.py --write-config-reference`), and
docs/architecture.md's package map has a line for every module.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachesvc.config import MetaNodeConfig, ServerConfig, env_names, load_config
from cachesvc.devcluster.procs import free_port
from cachesvc.devcluster.shard import LocalShard

from conftest import CacheServer, s3_args, wait_until

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("**/*.md")),
    *sorted((ROOT / "examples").glob("**/*.md")),
]
_FENCE = re.compile(r"^```(\w*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->\s*$")
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MAX_NOT_RUN = 4
"""Blocks that may be illustrative only, across all the docs: keep it rare."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    not_run: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the not-run reason of the line before it (blank lines aside)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        reason = _NOT_RUN.match(lines[before]) if before >= 0 else None
        blocks.append(Block(path, start + 1, match.group(1), "\n".join(body) + "\n", reason and reason.group(1)))
        i += 1
    return blocks


ALL_BLOCKS = [block for path in DOCS for block in code_blocks(path)]
RUNNABLE = [block for block in ALL_BLOCKS if block.lang in ("python", "sh", "bash") and block.not_run is None]


def test_blocks_that_do_not_run_say_why_and_are_few() -> None:
    assert RUNNABLE, "no runnable block found: the extractor is broken"
    skipped = [block for block in ALL_BLOCKS if block.not_run is not None]
    assert len(skipped) <= MAX_NOT_RUN, [block.name for block in skipped]
    for block in ALL_BLOCKS:
        assert block.lang, f"{block.name}: a fence without a language (python, sh, toml, text)"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "toml"], ids=lambda b: b.name)
def test_toml_blocks_are_valid_config(block: Block, tmp_path: Path) -> None:
    config = tmp_path / "block.toml"
    config.write_text(block.code)
    load_config(config, env={}, overrides={"s3.bucket": "b"})  # a namespace may need object storage


@dataclass
class Cluster:
    substitutions: dict[str, str]
    env: dict[str, str]


@pytest.fixture(scope="module")
def docs_cluster(s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("docs")
    prefix = f"docs-{base.name}/"
    objects = s3.client()
    for i in range(64):
        objects.put_object(Bucket=s3.bucket, Key=f"{prefix}imagenet/train/{i:05d}.jpg", Body=bytes([i]) * 3000)
    for i in range(8):
        objects.put_object(Bucket=s3.bucket, Key=f"{prefix}shards/{i:03d}.tar", Body=bytes([i]) * 1000)
    # The namespaces the README and the example set up: checkpoints write back, KV blocks stay in the cache.
    config = base / "cachesvc.toml"
    config.write_text(
        '[[namespaces]]\nprefix = "ckpt/"\nwrite_mode = "write-back"\n\n'
        + (ROOT / "examples/pd_disaggregation/kv.toml").read_text()
    )
    with LocalShard(3, base / "meta") as shard:
        shard.start()
        servers: list[CacheServer] = []
        metrics = f"127.0.0.1:{free_port()}"
        try:
            for i in range(2):
                args = [
                    "--config", str(config), "--l1-bytes", "256MiB", "--l2-path", str(base / f"l2-{i}"),
                    "--l2-bytes", "256MiB", *s3_args(s3, prefix),
                    "--meta", ",".join(shard.addresses), *(["--metrics-listen", metrics] if i == 0 else []),
                ]  # fmt: skip
                servers.append(CacheServer(args, base / "logs").start())
            nodes = shard.client(timeout=5.0)
            wait_until(
                lambda: set(nodes.placement(refresh=True).nodes) == {s.address for s in servers},
                30,
                "both cache servers in the placement",
                interval=0.2,
            )
            nodes.close()
            secured = _secured_cluster(base / "secured", servers)
            substitutions = {
                "--state-dir state": f"--state-dir {secured}",
                "127.0.0.1:7070": servers[0].address,
                "127.0.0.1:7071": servers[1].address,
                **{f"127.0.0.1:{7080 + i}": address for i, address in enumerate(shard.addresses)},
                "127.0.0.1:7170": metrics,
                "s3://cachesvc/": f"s3://{s3.bucket}/",
            }
            env = {
                "CACHECTL_CACHE": servers[0].address,
                "CACHECTL_META": ",".join(shard.addresses),
                "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                "AWS_ACCESS_KEY_ID": "cachesvc",
                "AWS_SECRET_ACCESS_KEY": "cachesvc-local-secret",
                "OMP_NUM_THREADS": "1",
            }
            yield Cluster(substitutions, env)
        finally:
            for server in servers:
                server.stop(grace=10.0)


def _secured_cluster(state: Path, servers: list[CacheServer]) -> Path:
    """What `cachesvc up --tokens --state-dir STATE` leaves for cachectl: a shard and a cache server with a data
    and an admin token, and `STATE/cluster.json` naming them (the README's tenant). Stopped with `servers`."""
    data_token, admin_token = "docs-data-token", "docs-admin-token"
    shard = LocalShard(1, state / "meta", token=data_token, admin_token=admin_token, peer_token="docs-peer-token")
    shard.start()
    env = {
        "CACHESVC_SECURITY_TOKEN": data_token,
        "CACHESVC_SECURITY_ADMIN_TOKEN": admin_token,
        "CACHESVC_META_HEARTBEAT_SECONDS": "0.3",
    }
    args = ["--l1-bytes", "64MiB", "--l2-bytes", "0", "--meta", ",".join(shard.addresses)]
    server = CacheServer(args, state / "logs", env).start()
    servers.append(server)
    server.stop = _and_then(server.stop, shard.stop)  # type: ignore[method-assign]
    info = {"meta": shard.addresses, "cache": [server.address], "token": data_token, "admin_token": admin_token}
    (state / "cluster.json").write_text(json.dumps(info))
    return state


def _and_then(first: Any, then: Any) -> Any:
    def both(*args: Any, **kwargs: Any) -> Any:
        try:
            return first(*args, **kwargs)
        finally:
            then()

    return both


def _runnable(block: Block, cluster: Cluster) -> str:
    code = block.code
    for default, actual in cluster.substitutions.items():
        code = code.replace(default, actual)
    return code


@pytest.mark.timeout(240)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_doc_block_runs(block: Block, docs_cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    code = _runnable(block, docs_cluster)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHECTL_")}
    env.update(docs_cluster.env)
    # A block of an example's page imports the example's modules, as its scripts do.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(block.path.parent), env.get("PYTHONPATH")]))
    shell = ["bash", "-e", "-o", "pipefail", "-c", code]
    # A block that imports vLLM runs in vLLM's venv (the Makefile's .venv-vllm; vLLM pins other releases).
    python = str(VLLM_PYTHON) if re.search(r"^(from|import) vllm\b", code, re.MULTILINE) else sys.executable
    argv = [python, "-c", code] if block.lang == "python" else shell
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, (
        f"{block.name} ({block.lang}) exited {result.returncode}\n--- code ---\n{code}"
        f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-5000:]}"
    )


# -- the configuration reference (docs/configuration.md) -----------------------------------------------

CONFIG_PAGE = ROOT / "docs" / "configuration.md"
CONFIG_SOURCE = ROOT / "cachesvc" / "config.py"
_DEPLOY_CONFIGS = {ServerConfig: ROOT / "deploy" / "cachesvc.toml", MetaNodeConfig: ROOT / "deploy" / "meta.toml"}
_REFERENCE_BEGIN = "<!-- config-reference: begin (python tests/test_docs.py --write-config-reference) -->"
_REFERENCE_END = "<!-- config-reference: end -->"
_DEPLOY_LINE = re.compile(r"^(?:#\s*)?(\w+)\s*=\s*.*?(?:\s#\s*(.*))?$")


@dataclass(frozen=True)
class ConfigKey:
    """One key of a config dataclass tree, as the reference page shows it."""

    key: str
    """Its dotted path in a TOML file; `namespaces[].prefix` for a key of an array of tables."""
    default: str
    """Its default, written as TOML writes it."""
    env: str
    """Its environment variable; empty for a list or a key inside one (a file or flags only)."""
    doc: str

    @property
    def row_start(self) -> str:
        """The beginning of its table row, which the page must hold as written."""
        return f"| `{self.key}` | `{self.default}` | {f'`{self.env}`' if self.env else '—'} |"


def _field_docs() -> dict[str, dict[str, str]]:
    """Each config class's field docstrings (the string under a field), by class name, from the source."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(CONFIG_SOURCE.read_text()).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for field_node, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                fields[field_node.target.id] = " ".join(after.value.value.split())
    return docs


def _deploy_comments(path: Path) -> dict[str, str]:
    """The comment beside each key of a deploy/*.toml file that shows every key, by dotted path."""
    comments: dict[str, str] = {}
    section = ""
    last = ""
    for line in path.read_text().splitlines():
        text = line.strip()
        table = re.match(r"^(?:#\s*)?\[\[?(\w+)\]\]?\s*$", text)
        if table:
            section = table.group(1) + ("[]" if "[[" in text else "")
            continue
        match = _DEPLOY_LINE.match(text)
        if match and "=" in text:
            last = f"{section}.{match.group(1)}" if section else match.group(1)
            comments[last] = match.group(2) or ""
        elif text.startswith("#") and line.startswith(" ") and last:
            comments[last] += " " + text.lstrip("# ")  # a comment continued under its key
    return comments


def _toml_value(value: Any, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, int) and name.endswith("bytes") and value:
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f'"{value // size}{unit}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item, name) for item in value) + "]"
    return repr(value)


def config_keys(schema: type[Any]) -> list[ConfigKey]:
    """Every key of a service's config dataclass tree, in the order the classes declare them."""
    docs = _field_docs()
    comments = _deploy_comments(_DEPLOY_CONFIGS[schema])
    env = {path: name for name, path in env_names(schema).items()}
    keys: list[ConfigKey] = []

    def walk(cls: type[Any], instance: Any, prefix: tuple[str, ...], in_list: bool) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint, value, path = hints[f.name], getattr(instance, f.name), (*prefix, f.name)
            if dataclasses.is_dataclass(hint):
                walk(typing.cast(type, hint), value, path, in_list)
                continue
            (item,) = typing.get_args(hint) or (None,)
            if typing.get_origin(hint) is list and dataclasses.is_dataclass(item):
                walk(typing.cast(type, item), typing.cast(type, item)(), (*prefix, f.name + "[]"), True)
                continue
            key = ".".join(path)
            # A subclass (MetaSecurityConfig) documents only the fields it adds.
            doc = next((docs[c.__name__][f.name] for c in cls.__mro__ if f.name in docs.get(c.__name__, {})), "")
            variable = "" if in_list else env.get(path, "")
            keys.append(ConfigKey(key, _toml_value(value, f.name), variable, doc or comments.get(key, "")))

    walk(schema, schema(), (), False)
    return keys


def _page_meanings() -> dict[str, str]:
    """The meaning each key has on the page now, for the keys whose source documents none."""
    _, _, generated = CONFIG_PAGE.read_text().partition(_REFERENCE_BEGIN)
    rows = re.findall(r"^\| `([^`]+)` \|[^|]*\|[^|]*\| (.*) \|$", generated, re.MULTILINE)
    return dict(rows)


def config_reference() -> str:
    """The reference tables of docs/configuration.md, from the config dataclasses (the text between its markers).

    A key whose class and deploy file say nothing about it keeps the meaning
    written on the page by hand.
    """
    written = _page_meanings()
    parts: list[str] = []
    for schema, title in ((ServerConfig, "cachesvc serve"), (MetaNodeConfig, "cachesvc meta")):
        doc = " ".join((schema.__doc__ or "").split("\n\n")[0].split())
        parts.append(f"### {schema.__name__}: `{title}`\n\n{doc}\n")
        parts.append("| key | default | environment variable | meaning |\n| --- | --- | --- | --- |")
        for key in config_keys(schema):
            meaning = key.doc.replace("|", "\\|") or written.get(key.key, "")  # a pipe would end the cell
            parts.append(f"{key.row_start} {meaning} |")
        parts.append("")
    return "\n".join(parts)


def write_config_reference() -> None:
    """Rewrites the generated part of docs/configuration.md from the config dataclasses."""
    page = CONFIG_PAGE.read_text()
    head, _, rest = page.partition(_REFERENCE_BEGIN)
    _, _, tail = rest.partition(_REFERENCE_END)
    CONFIG_PAGE.write_text(f"{head}{_REFERENCE_BEGIN}\n\n{config_reference()}\n{_REFERENCE_END}{tail}")


def test_configuration_page_names_every_config_key_with_its_default_and_variable() -> None:
    page = CONFIG_PAGE.read_text()
    missing = [key.row_start for schema in (ServerConfig, MetaNodeConfig) for key in config_keys(schema)]
    missing = [row for row in missing if row not in page]
    assert not missing, (
        "docs/configuration.md lacks these config keys (or shows another default or variable): "
        "run `python tests/test_docs.py --write-config-reference`\n" + "\n".join(missing)
    )


def test_configuration_page_names_no_key_the_config_lacks() -> None:
    known = {key.key for schema in (ServerConfig, MetaNodeConfig) for key in config_keys(schema)}
    _, _, generated = CONFIG_PAGE.read_text().partition(_REFERENCE_BEGIN)
    rows = re.findall(r"^\| `([^`]+)` \|", generated.partition(_REFERENCE_END)[0], re.MULTILINE)
    assert rows, "no reference table between the markers of docs/configuration.md"
    assert set(rows) <= known, f"keys the config no longer has: {sorted(set(rows) - known)}"


# -- links between the pages ---------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [p for p in DOCS if p.suffix == ".md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_lead_somewhere(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # another site's page
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there: {broken}"


# -- the package map (docs/architecture.md) ------------------------------------------------------------

ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = (ROOT / "cachesvc", ROOT / "client" / "cacheclient")
_MODULE_PATH = re.compile(r"^((?:cachesvc|client/cacheclient)/[\w/]+\.py)\s", re.MULTILINE)


def _modules() -> set[str]:
    """Every module of the two packages that a contributor reads, as a path from the repository root."""
    return {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in package.rglob("*.py")
        if "_proto" not in path.parts and path.name not in ("__init__.py", "__main__.py")
    }


def test_architecture_page_maps_every_module_and_no_module_that_is_gone() -> None:
    mapped = set(_MODULE_PATH.findall(ARCHITECTURE_PAGE.read_text()))
    modules = _modules()
    assert not modules - mapped, f"modules without a line in the package map: {sorted(modules - mapped)}"
    assert not mapped - modules, f"the package map names modules that are gone: {sorted(mapped - modules)}"


def _floors() -> dict[str, int]:
    """Each module the package map names, as a dotted name, and the floor it is on (1 at the top)."""
    floors: dict[str, int] = {}
    floor = 0
    for line in ARCHITECTURE_PAGE.read_text().splitlines():
        heading = re.match(r"^Floor (\d+)\b", line)
        module = _MODULE_PATH.match(line + " ")
        if heading:
            floor = int(heading.group(1))
        elif module and floor:
            name = module.group(1).removeprefix("client/").removesuffix(".py").replace("/", ".")
            floors[name] = floor
    return floors


def _source(name: str) -> Path | None:
    """The file of module or package `name` in this repository, if it is one of ours."""
    for base in (ROOT, ROOT / "client"):
        for path in (base / (name.replace(".", "/") + ".py"), base / name.replace(".", "/") / "__init__.py"):
            if path.exists():
                return path
    return None


def _imported(module: str, name: str | None) -> list[str]:
    """The mapped modules that `from module import name` (or `import module`) reaches, through a package's
    `__init__` to the module it takes the name from."""
    if name is not None and _source(f"{module}.{name}") is not None:
        module = f"{module}.{name}"
    source = _source(module)
    if source is None or source.name != "__init__.py":
        return [module]
    reached: list[str] = []
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and (name is None or name in (a.name for a in node.names)):
            reached += _imported(node.module, name if name is not None and _source(node.module) else None)
    return reached


def test_architecture_page_floors_are_the_way_imports_run() -> None:
    floors = _floors()
    wrong: list[str] = []
    for module, floor in floors.items():
        source = _source(module)
        assert source is not None, module
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [t for a in node.names for t in _imported(node.module, a.name)]
            elif isinstance(node, ast.Import):
                targets = [t for a in node.names for t in _imported(a.name, None)]
            else:
                continue
            for target in targets:
                if target not in floors or target == module:
                    continue
                if floors[target] < floor:
                    wrong.append(f"{module} (floor {floor}) imports {target} (floor {floors[target]}), above it")
                elif (
                    module.startswith("cachesvc.")
                    and floor > 1
                    and target.startswith("cacheclient.")
                    and floors[target] != 5
                ):
                    wrong.append(f"{module} (a server module) imports {target}, which is not on the neutral floor")
    assert not wrong, "docs/architecture.md's floors are not the way imports run:\n" + "\n".join(sorted(set(wrong)))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-config-reference"]:
        sys.exit("usage: python tests/test_docs.py --write-config-reference")
    write_config_reference()
