"""The public API as users name it: bst_fast.train(...), the exports, the packaging, and the
README's Python blocks run as tests.

README convention: every ```python block runs, in order, in one namespace, in a scratch folder
holding a link to configs/. An HTML comment on the line just before the fence changes that:
  <!-- readme-test: skip (reason) -->   never run (a corpus, a long run, a placeholder path)
  <!-- readme-test: cuda -->            run only where CUDA is available
  <!-- readme-test: slow -->            marked slow (deselect with -m "not slow")
"""
import fnmatch
import importlib
import importlib.metadata
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple

import pytest
import torch

import bst_fast
from bst_fast.config import TrainConfig, apply_overrides, resolve_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
TINY_MODEL = {"n_layer": 1, "d_model": 16, "n_head": 2, "head_hidden": 16}


# ---------------------------------------------------------------- the names

def test_train_is_the_function_after_importing_every_submodule():
    for info in pkgutil.walk_packages(bst_fast.__path__, "bst_fast."):
        importlib.import_module(info.name)
    assert callable(bst_fast.train) and not isinstance(bst_fast.train, type(bst_fast))
    assert bst_fast.train is bst_fast.trainer.train
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("bst_fast.train")  # no submodule may take the name


def test_train_is_the_function_when_a_submodule_is_imported_first():
    # A fresh interpreter, where `import bst_fast.<module>` runs before any use of the package.
    code = ("import bst_fast.trainer, bst_fast.decode, bst_fast.model, bst_fast.data, bst_fast.__main__\n"
            "import bst_fast\n"
            "from bst_fast import train\n"
            "assert callable(bst_fast.train) and train is bst_fast.train is bst_fast.trainer.train, bst_fast.train\n"
            "print('ok')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


EXPORTS = {
    "TextHead", "ResidualSwiGLUHead", "belief_state_loss", "BeliefStateLoss", "BACKENDS", "separated_documents",
    "train", "TrainConfig", "ModelConfig", "BeliefStateTransformer", "ForwardOnly", "TrainingStopped", "load_model",
    "sample", "plan", "Plan", "beam_search",
    "StarGraphTokenizer", "StarGraphData", "StarGraphStream", "path_accuracy", "TextData", "train_bpe",
    "load_tokenizer",
}


def test_exports():
    assert set(bst_fast.__all__) == EXPORTS and len(bst_fast.__all__) == len(EXPORTS)
    # The README's list of exports names each of them, and nothing else.
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("The package exports"):readme.index("Modules whose names start")]
    assert set(re.findall(r"`(\w+)`", paragraph)) - {"__all__"} == EXPORTS
    namespace = {}
    exec("from bst_fast import *", namespace)
    assert EXPORTS <= set(namespace)
    from bst_fast import config, decode, model, trainer

    assert bst_fast.TrainConfig is config.TrainConfig and bst_fast.ModelConfig is model.ModelConfig
    assert bst_fast.BeliefStateTransformer is model.BeliefStateTransformer
    assert bst_fast.plan is decode.plan and bst_fast.sample is decode.sample
    assert bst_fast.beam_search is decode.beam_search
    assert isinstance(bst_fast.__version__, str)


# ---------------------------------------------------------------- configs and overrides

def test_config_forms_agree():
    from_file = resolve_config(TINY)
    from_dict = resolve_config(json.loads(json.dumps(from_file.to_dict())))
    from_cfg = resolve_config(from_file)
    assert from_file == from_dict == from_cfg and from_cfg is not from_file
    assert resolve_config(str(TINY)) == from_file
    assert resolve_config() == TrainConfig()
    # A dict may use dotted keys and partial model mappings, like keyword overrides.
    assert resolve_config({"model.n_layer": 3}).model.n_layer == 3
    assert resolve_config({"model": {"n_layer": 3}}).model.d_model == TrainConfig().model.d_model


def test_overrides_nested_dotted_and_whole():
    base = TrainConfig.load(TINY)
    nested = resolve_config(TINY, model={"n_layer": 3}, steps=9)
    dotted = resolve_config(TINY, **{"model.n_layer": 3, "steps": 9})
    assert nested == dotted
    assert nested.model.n_layer == 3 and nested.model.d_model == base.model.d_model == 16  # the rest kept
    assert nested.steps == 9 and nested.batch_size == base.batch_size
    whole = resolve_config(TINY, model=bst_fast.ModelConfig(n_layer=2))
    assert whole.model == bst_fast.ModelConfig(n_layer=2)
    assert resolve_config(TINY, lr=1).lr == 1.0 and isinstance(resolve_config(TINY, lr=1).lr, float)
    assert resolve_config(TINY, pairs=0.5, **{"model.head_hidden": [8, 8]}).model.head_hidden == [8, 8]
    # In order: a later key wins.
    assert apply_overrides(base, {"model": {"n_layer": 5}, "model.n_layer": 6}).model.n_layer == 6
    assert TrainConfig.load(TINY) == base  # nothing was changed in place


def test_train_leaves_the_given_config_unchanged(tmp_path):
    cfg = TrainConfig.load(TINY)
    before = cfg.to_dict()
    result = bst_fast.train(cfg, out_dir=str(tmp_path), steps=2, eval_every=2, ckpt_every=0)
    assert cfg.to_dict() == before  # neither the overrides nor the data's vocab_size / max_len leak back
    assert result["loss"] > 0 and 0.0 <= result["path_accuracy"] <= 1.0
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()


@pytest.mark.parametrize("overrides, names", [
    ({"stpes": 1}, ["'stpes' is unknown", "did you mean 'steps'", "'batch_size'", "'model'"]),
    ({"model": {"n_layr": 2}}, ["'model.n_layr' is unknown", "did you mean 'model.n_layer'", "'head_hidden'"]),
    ({"model.n_layr": 2}, ["'model.n_layr' is unknown", "did you mean 'model.n_layer'", "of 'model'"]),
    ({"modle.n_layer": 2}, ["'modle.n_layer' is unknown", "'modle' is not a field", "did you mean 'model'"]),
    ({"steps.x": 2}, ["'steps.x' is unknown", "'steps' is a field of type int"]),
    ({"steps": "many"}, ["'steps' must be int"]),
    ({"model": 3}, ["'model' must be a mapping"]),
    ({"model.": 3}, ["'model.' is not a field name"]),
])
def test_bad_overrides_name_the_field_before_any_work(tmp_path, overrides, names):
    out = tmp_path / "never"
    with pytest.raises(ValueError) as err:
        bst_fast.train(TINY, out_dir=str(out), **overrides)
    for name in names:
        assert name in str(err.value), str(err.value)
    assert not out.exists()


def test_unknown_override_lists_every_known_field():
    with pytest.raises(ValueError) as err:
        bst_fast.train(stpes=1)
    assert all(repr(name) in str(err.value) for name in TrainConfig().to_dict())


def test_bad_config_arguments():
    with pytest.raises(TypeError, match="config must be"):
        bst_fast.train(3)
    with pytest.raises(FileNotFoundError, match="no_such.yaml.*star_cpu"):
        bst_fast.train("configs/no_such.yaml")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        bst_fast.train(ROOT / "configs")


def test_shipped_configs_load_by_name_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = TrainConfig.load(ROOT / "configs" / "star_cpu.yaml")
    for name in ("configs/star_cpu.yaml", "star_cpu.yaml", "star_cpu"):
        assert TrainConfig.load(name) == shipped, name
    assert resolve_config("star_g25_gpu", steps=3).steps == 3
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TrainConfig.load("elsewhere/star_cpu.yaml")  # only a bare name or configs/NAME
    # A file of the user's own, at the path given, comes first.
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "star_cpu.yaml").write_text("steps: 7\n")
    assert TrainConfig.load("configs/star_cpu.yaml").steps == 7


def test_setup_ships_the_configs_inside_the_package(monkeypatch):
    """A plain `pip install .` installs configs/ as bst_fast/configs, where bundled_configs looks."""
    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    exec(compile((ROOT / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    assert "bst_fast.configs" in seen["packages"] and "bst_fast.backends" in seen["packages"]
    assert seen["package_dir"]["bst_fast.configs"] == "configs"
    shipped = {p.name for p in (ROOT / "configs").iterdir()}
    assert shipped and all(any(fnmatch.fnmatch(n, g) for g in seen["package_data"]["bst_fast.configs"]) for n in shipped)


def test_cli_set_follows_the_same_rules(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY),
                          "--set", f"out_dir={tmp_path}", "--set", "stpes=1"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2
    assert "'stpes' is unknown" in run.stderr and "did you mean 'steps'" in run.stderr and "'batch_size'" in run.stderr


def test_a_bad_switch_variable_is_one_error_line_and_the_traceback_flag_reads_its_value(tmp_path):
    """A bad BST_FAST_* switch failed bst_fast's import: a traceback and exit 1 from the CLI, where the
    README promises one line `error: ...` and exit 2 for bad input. It is now reported when used (the
    CLI, train, belief_state_loss). BST_FAST_TRACEBACK=0 had turned tracebacks on (any value did)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    bad = {**env, "BST_FAST_FUSED_CE": "yes"}
    run = subprocess.run([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set", f"out_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=tmp_path, env=bad)
    assert run.returncode == 2 and run.stderr.strip() == "error: BST_FAST_FUSED_CE must be 0 or 1, got 'yes'", run.stderr
    code = ("import torch, bst_fast, pytest\n"
            "with pytest.raises(ValueError, match='BST_FAST_FUSED_CE must be 0 or 1'):\n"
            "    bst_fast.belief_state_loss(torch.randn(1, 5, 3), torch.randn(1, 5, 3), torch.zeros(1, 5, dtype=torch.long),\n"
            "                               bst_fast.TextHead(3, 4, hidden=4))\n"
            f"with pytest.raises(ValueError, match='BST_FAST_FUSED_CE'):\n    bst_fast.train({str(TINY)!r}, out_dir={str(tmp_path / 'x')!r})\n"
            "from bst_fast.backends import runtime\n"
            "with pytest.raises(ValueError, match='BST_FAST_FUSED_CE'):\n    runtime.SWITCHES  # a bench reading it directly\n"
            "print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=bad)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    assert not (tmp_path / "x").exists()
    # a fault (here a non-finite loss) with BST_FAST_TRACEBACK=0: one line, no traceback
    fault = [sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set", f"out_dir={tmp_path / 'nan'}",
             "--set", "lr=1e30", "--set", "grad_clip=0"]
    for flag, traced in (("0", False), ("1", True)):
        run = subprocess.run(fault + ["--overwrite"], capture_output=True, text=True, cwd=tmp_path,
                             env={**env, "BST_FAST_TRACEBACK": flag})
        assert run.returncode == 1 and ("Traceback" in run.stderr) == traced, run.stderr[-3000:]


def test_resume_and_overwrite_together_are_refused(tmp_path):
    """Both flags were accepted and --resume won silently: a user starting over got a continuation."""
    bst_fast.train(TINY, out_dir=str(tmp_path), stop_at=2)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"resume \(--resume\) continues .* overwrite \(--overwrite\) starts it over"):
        bst_fast.train(TINY, out_dir=str(tmp_path), resume=True, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("text, suffix", [("steps: 5000\nlr: 0.001\nsteps: 50\n", ".yaml"),
                                          ("model:\n  n_layer: 8\n  d_model: 32\n  n_layer: 2\n", ".yaml"),
                                          ('{"steps": 5000, "steps": 50}', ".json")])
def test_a_config_key_written_twice_is_refused(tmp_path, text, suffix):
    """YAML and JSON keep the last of two equal keys silently: `steps: 5000 ... steps: 50` trained 50."""
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"key '(steps|n_layer)' appears twice"):
        TrainConfig.load(path)
    from bst_fast.config import load_yaml
    # a merge key overriding its base stays YAML's own rule, nested merges too (an anchored mapping
    # flattened in place once read as a duplicate)
    assert load_yaml("base: &b\n  n_layer: 8\nmodel:\n  <<: *b\n  n_layer: 2\n")["model"]["n_layer"] == 2
    nested = "base: &base {k: 1}\na:\n  b:\n    mid: &mid\n      <<: *base\n      k: 2\ntop:\n  <<: *mid\n"
    assert load_yaml(nested)["top"] == {"k": 2}


@pytest.mark.parametrize("changes, field", [
    ({"seed": 2**40}, "seed"), ({"seed": 10**20}, "seed"),
    ({"model.mlp_ratio": 1e308}, "mlp_ratio"), ({"model.mlp_ratio": 2**24}, "mlp_ratio"),
    ({"model.d_model": 10**400, "model.n_head": 1}, "'model.d_model' must be at most 2**24"),  # was blamed on mlp_ratio
    ({"model.gpt_head": True}, "model.gpt_head"),
])
def test_values_the_run_cannot_use_are_refused_naming_the_field(changes, field):
    """Accepted before and failed later without naming the field (an overflow in torch's seed, in
    the MLP's width), or silently replaced (gpt_head is set from gamma)."""
    with pytest.raises(ValueError, match=re.escape(field)):
        resolve_config(TINY, **changes).check()
    assert resolve_config(TINY, seed=2**40 - 1, gamma=0.5, **{"model.gpt_head": True}).check()


def test_set_reads_none_as_python_writes_it(tmp_path):
    from bst_fast.config import apply_sets

    cfg = apply_sets(resolve_config(TINY, max_gap=5), ["max_gap=none", "pairs=None", "out_dir=none"])
    assert cfg.max_gap is None and cfg.pairs is None and cfg.out_dir == "none"


# ---------------------------------------------------------------- packaging

def test_cli_help_names_the_command():
    from bst_fast.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


def test_console_script_is_declared_and_runs():
    try:
        dist = importlib.metadata.distribution("bst_fast")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("bst_fast is not installed (pip install --no-build-isolation -e .)")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    if "bst-fast" not in scripts:
        pytest.skip("the installed metadata predates pyproject.toml: reinstall with pip install --no-build-isolation -e .")
    assert scripts["bst-fast"] == "bst_fast.__main__:cli"
    exe = shutil.which("bst-fast") or str(Path(sys.executable).parent / "bst-fast")
    assert Path(exe).exists(), "bst-fast is declared but not on PATH"
    run = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("usage: bst-fast") and "train" in run.stdout and "generate" in run.stdout


def test_pyproject_declares_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert "dependencies" in project["dynamic"]  # setup.py's RUNTIME: torch pinned to the build's
    extras = project["optional-dependencies"]
    assert {"pytest", "pytest-benchmark"} <= set(extras["test"]) and "matplotlib" in extras["bench"]
    assert project["scripts"] == {"bst-fast": "bst_fast.__main__:cli"}
    assert meta["build-system"]["build-backend"] == "setuptools.build_meta"
    assert "CppExtension" in (ROOT / "setup.py").read_text()  # the extension is still setuptools-built
    # requirements.txt pins only what the build and CI need: no runtime dependency twice.
    reqs = {re.split(r"[<>=;\[ ]", line.strip())[0].lower() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}
    assert not reqs & {"numpy", "tqdm", "pyyaml", "safetensors", "tokenizers", "triton", "torch"}, reqs


def test_an_isolated_build_is_told_to_turn_isolation_off(tmp_path):
    """An isolated build took the newest torch (build-system requires), compiled against it (torch 2.14:
    C++20 errors under the old -std=c++17) and pinned the package to it, replacing the user's torch
    (review helper-110): without torch in the build's environment setup.py says what to do."""
    tomllib = pytest.importorskip("tomllib")
    build_requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in build_requires if r.lower().startswith("torch")]
    hide = tmp_path / "torch"  # a package named torch that cannot be imported: as if torch were missing
    hide.mkdir()
    (hide / "__init__.py").write_text("raise ImportError('no torch here')\n")
    run = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=120)
    assert run.returncode != 0 and "torch installed first" in run.stderr and "--no-build-isolation" in run.stderr
    assert '"-std=c++' not in (ROOT / "setup.py").read_text()  # the C++ standard is torch's own choice


def test_the_installed_package_requires_the_torch_it_was_built_with():
    """The C++ extension keeps no ABI across torch versions: the metadata pins the torch of the
    build (review helper-74: `torch>=2.4` let pip keep or take another one), and lists the rest."""
    try:
        requires = importlib.metadata.requires("bst_fast") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("bst_fast is not installed")
    names = {re.split(r"[<>=!~;\[ ]", r)[0].lower(): r for r in requires}
    assert names.get("torch", "").replace(" ", "") == f"torch=={torch.__version__.split('+')[0]}", requires
    for name in ("numpy", "tqdm", "pyyaml", "safetensors", "tokenizers", "triton"):
        assert name in names, (name, requires)
    assert "sys_platform" in names["triton"] and "linux" in names["triton"]


def test_installed_version_matches_the_package():
    try:
        version = importlib.metadata.version("bst_fast")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("bst_fast is not installed")
    assert version == bst_fast.__version__


# ---------------------------------------------------------------- the README's Python blocks

class Snippet(NamedTuple):
    index: int
    line: int  # the README line of the block's first code line
    code: str
    tags: List[str]


def readme_snippets(text: str) -> List[Snippet]:
    lines = text.splitlines()
    out, k = [], 0
    while k < len(lines):
        if lines[k].strip() == "```python":
            start = k + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            prev = lines[k - 1].strip() if k else ""
            m = re.fullmatch(r"<!--\s*readme-test:\s*(.*?)\s*-->", prev)
            tags = [t.strip().split(" ")[0] for t in m.group(1).split(",")] if m else []
            unknown = set(tags) - {"skip", "cuda", "slow"}
            if unknown:
                raise ValueError(f"README.md:{k}: unknown readme-test tags {sorted(unknown)}")
            out.append(Snippet(len(out), start + 1, "\n".join(lines[start:end]), tags))
            k = end
        k += 1
    return out


SNIPPETS = readme_snippets((ROOT / "README.md").read_text())


def _runs(s: Snippet) -> bool:
    return "skip" not in s.tags and ("cuda" not in s.tags or torch.cuda.is_available())


class _ReadmeSession:
    """One namespace and one scratch folder for all blocks; a block run alone (pytest -k) first
    runs the blocks before it, as a reader would have."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.namespace = {"__name__": "__readme__"}
        self.done = set()

    def run(self, snippet: Snippet):
        for s in SNIPPETS[:snippet.index]:
            if _runs(s) and s.index not in self.done:
                self._exec(s)
        self._exec(snippet)

    def _exec(self, s: Snippet):
        self.done.add(s.index)  # a failing block is reported once, by its own test
        code = compile("\n" * (s.line - 1) + s.code, str(ROOT / "README.md"), "exec")
        here = os.getcwd()
        os.chdir(self.folder)
        try:
            exec(code, self.namespace)
        finally:
            os.chdir(here)


@pytest.fixture(scope="module")
def readme_session(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    (folder / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    return _ReadmeSession(folder)


def _params():
    for s in SNIPPETS:
        marks = []
        if "skip" in s.tags:
            marks.append(pytest.mark.skip(reason="README block marked readme-test: skip"))
        if "cuda" in s.tags:
            marks += [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
        if "slow" in s.tags:
            marks.append(pytest.mark.slow)
        yield pytest.param(s, id=f"README.md:{s.line}", marks=marks)


def test_readme_has_python_blocks():
    assert len(SNIPPETS) >= 4
    assert any("bst_fast.train(" in s.code and _runs(s) for s in SNIPPETS)
    assert "bst_fast.train.train" not in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("snippet", list(_params()))
def test_readme_python_block(readme_session, snippet):
    readme_session.run(snippet)
