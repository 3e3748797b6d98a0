"""Every command block of README.md and docs/*.md, taken from the files themselves and run shrunk (tests/doccommands.py
says how, and what the `<!-- doc-test: ... -->` markers mean), so an example that went stale fails here; and every
repository path the docs name exists.

`python -m` commands and python blocks run in this process (runpy, as `python -m` runs a module), one fresh
directory per block; torchrun commands run as processes."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.doccommands import REPO, Block, Command, all_commands, doc_files, shrink

# ---------------------------------------------------------------------------------------------------------------
# Named setups: the files a block's placeholders name, written into its directory before it runs.


def _hf_models(cwd: Path) -> None:
    """README "Bring your own model and loop": path/to/config.json, DIR and MIXTRAL_DIR (tiny configs), and
    path/to/save_pretrained_dir (a tiny Llama's weights)."""
    from tests.hf.tiny import plain_model, write_config

    room = dict(max_position_embeddings=256)  # the shrunk runs' 128-token sequences
    write_config(cwd / "path" / "to", "llama", **room)
    write_config(cwd / "DIR", "llama", **room)
    write_config(cwd / "MIXTRAL_DIR", "mixtral", **room)
    plain_model("llama", **room).save_pretrained(cwd / "path" / "to" / "save_pretrained_dir")


def _bpe_tokenizer(path: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))


def _texts() -> list[str]:
    import pydoc_data.topics

    return [text for _, text in sorted(pydoc_data.topics.topics.items())[:40]]


def _text_corpus(cwd: Path) -> None:
    """docs/data.md's example: my_tokenizer/tokenizer.json (a small byte-level BPE), books/ (.txt files) and
    extra/*.jsonl (a document a paragraph: enough for the default 1% validation split), from the text of Python's
    help topics."""
    texts = _texts()
    _bpe_tokenizer(cwd / "my_tokenizer" / "tokenizer.json", texts)
    (cwd / "books").mkdir()
    for i, text in enumerate(texts):
        (cwd / "books" / f"{i:02d}.txt").write_text(text)
    (cwd / "extra").mkdir()
    paragraphs = [p for text in texts for p in text.split("\n\n") if p.strip()]
    (cwd / "extra" / "topics.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))


def _prepared_corpus(cwd: Path) -> None:
    """DIR: a corpus written by recipes.prepare_data (docs/data.md's "The format")."""
    from recipes import prepare_data

    _text_corpus(cwd)
    prepare_data.main(["--quiet", "--tokenizer", str(cwd / "my_tokenizer" / "tokenizer.json"), "--out",
                       str(cwd / "DIR"), str(cwd / "books"), str(cwd / "extra")])


SETUPS = {"hf_models": _hf_models, "text_corpus": _text_corpus, "prepared_corpus": _prepared_corpus}

# ---------------------------------------------------------------------------------------------------------------
# Running one command.


def _run_module(module: str, args: list[str], cwd: Path) -> int:
    """`python -m module args` in this process, from cwd: its exit status."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = [module, *args]
    os.chdir(cwd)
    try:
        with warnings.catch_warnings():  # (runpy warns that the module was imported before: the tests import it)
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        GlobalHydra.instance().clear()


def _run_torchrun(command: Command, args: list[str], nproc: int, cwd: Path) -> None:
    from tests.multirank import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *command.launcher_opts, "-m", command.module, *args]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{command.id}: `{command.text}` run as {' '.join(argv[1:])} exited "
                                  f"{done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


def _run_python(command: Command, cwd: Path) -> None:
    saved = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(command.code, command.block.id, "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(saved)


def _run(command: Command, cwd: Path) -> None:
    if command.kind == "unknown":
        pytest.fail(command.unknown())
    if command.kind == "python":
        _run_python(command, cwd)
        return
    if command.kind == "mkdir":
        for d in command.args:
            assert not os.path.isabs(d), (f"{command.id}: mkdir of {d} outside the test's directory: point it there "
                                          f"with <!-- doc-test: replace=\"{d}=RELATIVE\" -->")
            (cwd / d).mkdir(parents=True, exist_ok=True)
        return
    args, nproc = shrink(command)
    if command.kind == "torchrun":
        _run_torchrun(command, args, nproc, cwd)
        return
    code = _run_module(command.module, args, cwd)
    assert code == 0, (f"{command.id}: `{command.text}` run as `python -m {command.module} {' '.join(args)}` "
                       f"exited {code}")


# ---------------------------------------------------------------------------------------------------------------
# A block's commands run in order in one directory; a command first runs the earlier ones it may depend on.


@dataclass
class BlockRun:
    cwd: Path
    done: dict[int, str | None] = field(default_factory=dict)  # index -> None (ran) or why it failed


_RUNS: dict[str, BlockRun] = {}


def _block_run(block: Block, tmp_path_factory) -> BlockRun:
    if block.id not in _RUNS:
        cwd = tmp_path_factory.mktemp(re.sub(r"\W", "_", block.id))
        for m in block.markers:
            if "setup" in m.options:
                SETUPS[m.options["setup"]](cwd)
        _RUNS[block.id] = BlockRun(cwd)
    return _RUNS[block.id]


def _runs_here(command: Command) -> bool:
    return command.kind not in ("install", "unknown") and (command.verdict() or ("run",))[0] != "skip"


def _run_in_block(command: Command, tmp_path_factory) -> None:
    run = _block_run(command.block, tmp_path_factory)
    slow = command.verdict() is not None
    for earlier in command.block.commands()[:command.index - 1]:
        if earlier.index in run.done or not _runs_here(earlier) or (earlier.verdict() is not None and not slow):
            continue
        try:
            _run(earlier, run.cwd)
            run.done[earlier.index] = None
        except (Exception, pytest.fail.Exception) as e:
            run.done[earlier.index] = f"{type(e).__name__}: {e}"
    try:
        _run(command, run.cwd)
        run.done[command.index] = None
    except (Exception, pytest.fail.Exception) as e:
        run.done[command.index] = f"{type(e).__name__}: {e}"
        failed = {i: why for i, why in run.done.items() if why and i < command.index}
        if failed and hasattr(e, "add_note"):  # (it may have needed what they make; notes: Python 3.11+)
            e.add_note(f"an earlier command of {command.block.id} failed first: {failed}")
        raise


def _params() -> list:
    params = []
    for c in all_commands():
        verdict = c.verdict()
        if c.kind == "install" and verdict is None:
            verdict = ("skip", "installs the environment these tests run in")
        marks = ([pytest.mark.skip(reason=verdict[1])] if verdict and verdict[0] == "skip"
                 else [pytest.mark.slow] if verdict else [])
        params.append(pytest.param(c, id=c.id, marks=marks))
    return params


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("command", _params())
def test_doc_command(command: Command, tmp_path_factory):
    _run_in_block(command, tmp_path_factory)


# ---------------------------------------------------------------------------------------------------------------
# Paths named in the docs.

_PATH = re.compile(r"(?<![\w./-])((?:moe|sequence_parallel|zero|kernels|integrations|recipes|tests|benchmarks|docs)"
                   r"/[\w./-]*[\w/])(?![\w<{*.-])")  # (not a pattern such as moe/layer<i>/... or benchmarks/*.py)


def doc_paths() -> dict[str, list[str]]:
    """Every repository path a doc names (in code spans, blocks and prose): path -> where."""
    found: dict[str, list[str]] = {}
    for doc in doc_files():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for path in _PATH.findall(line):
                found.setdefault(path.split("::")[0], []).append(f"{doc.relative_to(REPO)}:{n}")
    return found


def test_every_repository_path_the_docs_name_exists():
    missing = {p: where for p, where in doc_paths().items() if not (REPO / p).exists()}
    assert not missing, f"paths named in README.md / docs/*.md that do not exist: {missing}"


def layout_paths() -> dict[str, str]:
    """The README's Layout tree: each row's folder, and the files and folders its description names (relative to
    that folder) -> the row."""
    text = (REPO / "README.md").read_text()
    tree = re.search(r"## Layout\n+```\n(.*?)```", text, re.S)
    assert tree, "README.md has no Layout tree"
    found, top, folder = {}, "", ""
    for line in tree.group(1).splitlines():
        indent = len(line) - len(line.lstrip())
        name, _, description = line.strip().partition(" ")
        if indent <= 2:  # a row: "name/   what it holds" (two spaces in: a sub-folder of the row above)
            folder = name if indent == 0 else top + name
            top = folder if indent == 0 else top
            found[folder] = line.strip()
        else:  # the row's description goes on
            description = line.strip()
        for named in re.findall(r"(?<![\w./])([a-z_]+(?:/[a-z_]+)*(?:\.py|/))(?![\w.])", description):
            found[folder + named] = line.strip()
    return found


def test_the_readme_layout_names_what_exists():
    missing = {p: row for p, row in layout_paths().items() if not (REPO / p).exists()}
    assert not missing, f"README.md's Layout names what does not exist: {missing}"


def test_the_readme_layout_names_every_package_folder():
    """A new sub-package shows up in the Layout (zero/optim/ and recipes/planner/ once did not)."""
    from tests.test_wheel import INSTALLED_AS

    named = {str(parent) for p in layout_paths() for parent in (Path(p), *Path(p).parents)}
    folders = {str(d.relative_to(REPO)) for top in INSTALLED_AS for d in (REPO / top).rglob("*")
               if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))}
    assert not folders - named, f"package folders README.md's Layout does not name: {sorted(folders - named)}"


# ---------------------------------------------------------------------------------------------------------------
# Names the docs give in code spans: Python objects (`zero.dist.comm.start_watchdog`) and config keys
# (`train.stop_grace_s`).

_PACKAGES = ("moe_lst", "moe", "zero", "recipes", "sequence_parallel")
_SECTIONS = ("model", "train", "optim", "parallel", "data", "wandb", "cluster", "zero")
_NAME = re.compile(rf"`((?:{'|'.join(dict.fromkeys(_PACKAGES + _SECTIONS))})(?:\.\w+)+)(\(?)")
_FILE_SUFFIXES = ("py", "md", "yaml", "json", "jsonl", "safetensors", "txt", "bin", "idx", "png", "sh")


def _python_name(name: str) -> bool:
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def _config_keys() -> set[str]:
    """Every key of the recipe's config under each choice of the groups whose keys differ, and the cluster keys."""
    import yaml
    from omegaconf import DictConfig

    from recipes.config import compose_command_line

    keys: set[str] = set()

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node.keys():
            keys.add(prefix + key)
            child = node._get_node(key)
            if isinstance(child, DictConfig):
                walk(child, f"{prefix}{key}.")

    datas = [[f"data={p.stem}"] for p in sorted((REPO / "recipes" / "conf" / "data").glob("*.yaml"))]
    for choice in ([], ["model=hf"], *datas, ["optim=onebit_adam"], ["+experiment=million"]):
        walk(compose_command_line(choice), "")
    for preset in (REPO / "recipes" / "conf" / "cluster").glob("*.yaml"):
        keys.update(f"cluster.{k}" for k in yaml.safe_load(preset.read_text()))
    return keys


def test_every_name_the_docs_give_exists():
    keys = _config_keys()
    unknown: dict[str, list[str]] = {}
    for doc in doc_files():
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for name, call in _NAME.findall(line):
                head, last = name.split(".")[0], name.rsplit(".", 1)[1]
                if last in _FILE_SUFFIXES or (call and head not in _PACKAGES):  # a file; code on a variable
                    continue
                if not ((head in _PACKAGES and _python_name(name)) or (head in _SECTIONS and name in keys)):
                    unknown.setdefault(name, []).append(f"{doc.relative_to(REPO)}:{n}")
    assert not unknown, f"names in README.md / docs/*.md that are neither a Python object nor a config key: {unknown}"
