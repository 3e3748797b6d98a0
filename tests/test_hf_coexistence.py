"""This project and Hugging Face `transformers` (5.x) in one environment, with and without Hugging Face's `kernels`
distribution (a dependency of transformers >= 5.25, imported when a model class loads).

Our kernels/ directory is installed and imported as `moe_lst.kernels`, so nothing of ours answers to the top-level
name `kernels`: each case imports our packages and builds a tiny Llama and Mixtral from a config (no download), in a
fresh interpreter, from the repository root (where kernels/ lies on sys.path as a directory without __init__.py)
and from another directory. "Without" runs the same interpreter over a view of site-packages that leaves out
`kernels` and its dist-info (module and metadata both gone, as after `pip uninstall kernels`); a sys.meta_path
blocker cannot hide the metadata, and a scratch venv takes minutes.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter (`python -c`, so the working directory is sys.path[0]); prints one JSON line.
PROBE = r"""
import importlib, importlib.util, json, sys
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.utils import is_kernels_available

ours = ["moe_lst.kernels.attention", "moe_lst.kernels.sparse", "moe_lst.kernels.nsa", "moe_lst.kernels.positions",
        "moe", "sequence_parallel", "zero", "recipes", "moe_lst.models.llama", "recipes.export"]
for name in ours:
    importlib.import_module(name)
tiny = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16)
tokens = torch.tensor([[1, 2, 3]])
with torch.no_grad():
    shapes = [list(LlamaForCausalLM(LlamaConfig(**tiny)).eval()(tokens).logits.shape),
              list(MixtralForCausalLM(MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **tiny)).eval()(
                  tokens).logits.shape)]
def where(module):  # a module's file; "namespace" for a directory without __init__.py; None when absent
    return None if module is None else getattr(module, "__file__", None) or "namespace"
by_transformers = where(sys.modules.get("kernels"))  # what transformers imported under the name, if anything
try:
    import kernels
except ImportError:
    kernels = None
print(json.dumps({
    "transformers": transformers.__version__, "shapes": shapes, "kernels_available": is_kernels_available(),
    "by_transformers": by_transformers, "import_kernels": where(kernels),
    "moe_lst_kernels": [str(p) for p in importlib.import_module("moe_lst.kernels").__path__],
    "attention": importlib.import_module("moe_lst.kernels.attention").__file__,
}))
"""


def _hf_kernels():
    try:
        return importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None


def _site_without_kernels(root: Path) -> list[Path]:
    """A view (symlinks) of every site-packages directory, less Hugging Face's `kernels` and its metadata."""
    views = []
    for i, site_dir in enumerate(site.getsitepackages()):
        if not os.path.isdir(site_dir):
            continue
        view = root / f"site{i}"
        view.mkdir(parents=True)
        for entry in os.scandir(site_dir):
            if entry.name == "kernels" or re.fullmatch(r"kernels-[^-]+\.(dist|egg)-info", entry.name):
                continue
            (view / entry.name).symlink_to(entry.path)
        views.append(view)
    return views


def _start(cwd: Path, views: list[Path] | None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    if views is None:
        args = [sys.executable, "-c", PROBE]
    else:  # -S: no site-packages but the views (whose .pth files, the editable install's among them, still run)
        args = [sys.executable, "-S", "-c", f"import site\nfor v in {[str(v) for v in views]!r}: site.addsitedir(v)\n"
                + PROBE]
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_this_project_and_transformers_with_and_without_hf_kernels(tmp_path):
    if _hf_kernels() is None:
        pytest.skip("Hugging Face's kernels is not installed: only the 'without' case would run")
    views = _site_without_kernels(tmp_path / "without")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # With Hugging Face's kernels installed, the repository root is the case where ours could shadow it (kernels/ is
    # on sys.path there; what the installed project routes applies in every directory): "elsewhere" runs without it
    # only, where the two directories differ (an empty namespace package or nothing).
    cases = {("with", "repo root"): (REPO, None), ("without", "repo root"): (REPO, views),
             ("without", "elsewhere"): (elsewhere, views)}
    procs = {case: _start(where, view) for case, (where, view) in cases.items()}  # concurrently: ~4 CPU s each
    results = {}
    try:
        for case, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"{case}: {err[-3000:]}"
            results[case] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    hf_kernels = Path(_hf_kernels().locate_file("kernels/__init__.py")).resolve()
    for (kind, where), r in results.items():
        assert r["shapes"] == [[1, 3, 32], [1, 3, 32]], (kind, where)
        assert Path(r["attention"]).parent in [Path(p) for p in r["moe_lst_kernels"]], (kind, where)
        if kind == "with":  # transformers finds and loads Hugging Face's kernels; so does `import kernels`
            assert r["kernels_available"], (kind, where, r)
            assert r["by_transformers"] in (None, r["import_kernels"]), (kind, where, r)
            assert Path(r["import_kernels"]).resolve() == hf_kernels, (kind, where, r)
        else:  # transformers finds no kernels
            assert not r["kernels_available"], (kind, where, r)
            # From the repository root, kernels/ (no __init__.py) is on sys.path: `import kernels` gives it as an
            # empty namespace package (which transformers' probe rejects for having no __file__). Elsewhere there is
            # no `kernels` at all: the installed project routes only moe_lst.kernels.
            assert r["import_kernels"] == ("namespace" if where == "repo root" else None), (kind, where, r)
            assert r["by_transformers"] in (None, r["import_kernels"]), (kind, where, r)


def test_the_installed_distribution_owns_no_top_level_kernels():
    """`pip uninstall moe-lst` removes the files its RECORD lists (an editable install: its finder, whose MAPPING
    routes our names): none is, or routes, a top-level `kernels`, and none belongs to Hugging Face's kernels."""
    # The installed one, not the moe_lst.egg-info of an in-tree build that the repository root on sys.path shows.
    installed = [*site.getsitepackages(), site.getusersitepackages()]
    dist = next(iter(importlib.metadata.distributions(name="moe-lst", path=installed)), None)
    if dist is None:
        pytest.skip("moe-lst is not installed (pip install -e .)")
    files = dist.files or []
    assert "kernels" not in (dist.read_text("top_level.txt") or "").split()
    assert "kernels" not in {f.parts[0] for f in files}
    finders = [f for f in files if re.fullmatch(r"__editable___.*_finder\.py", f.name)]
    for finder in finders:
        mapping = ast.literal_eval(re.search(r"^MAPPING[^=]*=\s*(\{.*\})$", finder.read_text(), re.M).group(1))
        assert "moe_lst.kernels" in mapping
        assert not [name for name in mapping if name.split(".")[0] == "kernels"], mapping
    if not finders:  # a regular install: our kernels live under moe_lst/
        assert any(f.parts[:2] == ("moe_lst", "kernels") for f in files)
    hf = _hf_kernels()
    if hf is not None:
        ours = {Path(f.locate()).resolve() for f in files}
        assert not ours & {Path(f.locate()).resolve() for f in hf.files or []}
