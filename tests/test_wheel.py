"""The built wheel, installed where the checkout cannot be seen: it holds every package and data file of the source
tree and nothing else, each package imports from it, and the README's quick-start run and a plan run from a
directory outside the checkout.

The fresh virtual environment borrows this environment's dependencies (torch, transformers, ...) through a .pth line
naming this environment's site-packages: a path line only adds that directory, so the .pth files there (the editable
install's finder among them) are not run, and the checkout stays invisible."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.doccommands import REPO, all_commands, shrink

#: Source folder -> its place in the wheel (kernels/, models/ and integrations/ install under the moe_lst namespace).
INSTALLED_AS = {"moe": "moe", "sequence_parallel": "sequence_parallel", "zero": "zero", "recipes": "recipes",
                "kernels": "moe_lst/kernels", "models": "moe_lst/models", "data": "moe_lst/data",
                "integrations": "moe_lst/integrations"}
NOT_SHIPPED = (".md",)  # documentation beside the code (integrations/README.md)


def _source_files() -> list[str]:
    """The checkout's files as git sees them (tracked, or new and not ignored), present on disk."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return sorted(p for p in set(out.split("\0")) if p and (REPO / p).is_file())


def _expected_wheel_files(files: list[str]) -> set[str]:
    """Every file under the installed folders but documentation, at its installed path."""
    expected = set()
    for path in files:
        top, _, rest = path.partition("/")
        if top in INSTALLED_AS and rest and not path.endswith(NOT_SHIPPED):
            expected.add(f"{INSTALLED_AS[top]}/{rest}")
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's source files (the build writes into its source folder)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the source file list comes from git")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for path in _source_files():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_bytes((REPO / path).read_bytes())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--wheel-dir", str(root / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = (root / "dist").glob("moe_lst-*.whl")
    return built


def test_wheel_holds_the_source_tree(wheel):
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    want = _expected_wheel_files(_source_files())
    assert names == want, (f"missing from the wheel: {sorted(want - names)}; "
                           f"in the wheel but not expected: {sorted(names - want)}")
    # (the data the code reads at run time: the Hydra configs and the CPU kernel's source)
    assert {"recipes/conf/config.yaml", "recipes/conf/cluster/cpu.yaml",
            "moe_lst/kernels/csrc/block_sparse.cpp"} <= names


def _fresh_env(root: Path, wheel: Path) -> Path:
    """A virtual environment outside the checkout with the wheel installed and this environment's site-packages
    after its own; its python."""
    env = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    # Installed before the .pth line exists, so pip sees an empty environment (never this one's editable install).
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--no-compile", "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])
    parents = [p for p in ours if Path(p).is_dir()]
    (purelib / "parent_environment.pth").write_text("".join(f"{p}\n" for p in parents))
    return python


# Run by the fresh environment's python from a directory outside the checkout: where everything comes from, every
# package imported, then the plan and the quick start as `python -m` runs them (runpy), one process for all.
CHECK = textwrap.dedent('''
    import importlib, json, os, runpy, sys
    from pathlib import Path

    repo, prefix, packages, plan, pretrain = json.loads(sys.argv[1])
    # (setuptools' editable finders are classes on sys.meta_path, from modules named __editable__...)
    editable = [f for f in sys.meta_path if "__editable__" in (getattr(f, "__module__", None) or "")]
    editable += [name for name in sys.modules if name.startswith("__editable__")]
    assert not editable, f"an editable install's finder is active: {editable}"
    assert Path(repo) not in [Path(p or ".").resolve() for p in sys.path], f"the checkout is on sys.path: {sys.path}"
    for name in packages:
        module = importlib.import_module(name)
        where = getattr(module, "__file__", None) or list(module.__path__)[0]
        assert Path(where).resolve().is_relative_to(Path(prefix).resolve()), f"{name} imported from {where}"

    def run(module, args):
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code in (0, None), f"python -m {module} {' '.join(args)} exited {e.code}"

    run("recipes.plan", plan)
    run("recipes.pretrain", pretrain)
    print("CHECKED", len(packages))
''')


def _packages(wheel: Path) -> list[str]:
    """Every package of the wheel (a folder holding .py files), as a dotted name."""
    folders = {n.rsplit("/", 1)[0] for n in zipfile.ZipFile(wheel).namelist()
               if n.endswith(".py") and ".dist-info/" not in n}
    return sorted(f.replace("/", ".") for f in folders)


def _readme_command(module: str) -> list[str]:
    """The arguments of the first README command running `module`, shrunk as the doc tests shrink it."""
    for command in all_commands():
        if command.block.doc.name == "README.md" and command.kind == "module" and command.module == module:
            return shrink(command)[0]
    raise AssertionError(f"README.md has no `python -m {module}` command")


def test_installed_wheel_imports_and_runs_outside_the_checkout(wheel, tmp_path):
    python = _fresh_env(tmp_path, wheel)
    work = tmp_path / "work"
    work.mkdir()
    packages = _packages(wheel)
    assert {"zero.optim", "recipes.planner", "moe_lst.kernels", "moe_lst.kernels.sparse",
            "moe_lst.integrations"} <= set(packages)
    pretrain = _readme_command("recipes.pretrain")  # the quick start: `python -m recipes.pretrain`
    plan = _readme_command("recipes.plan")
    assert "model=moe_tiny" in pretrain and "train.steps=2" in pretrain and "--world" in plan
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    prefix = str(tmp_path / "venv")
    done = subprocess.run([str(python), "-c", CHECK, json.dumps([str(REPO), prefix, packages, plan, pretrain])],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and f"CHECKED {len(packages)}" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]
    run_dir = work / next(a.split("=", 1)[1] for a in pretrain if a.startswith("run_dir="))
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
