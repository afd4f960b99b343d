"""The config's field rules (bst_fast/config.py): how a YAML/JSON file, a dict, keyword overrides
and --set values are read, and the values refused with the field named. No training here."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from bst_fast.config import TrainConfig, apply_sets, resolve_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"


def load(tmp_path, text, name="c.yaml"):
    (tmp_path / name).write_text(text)
    return TrainConfig.load(tmp_path / name)


@pytest.mark.parametrize("text, field", [("pack: on", "pack"), ("pack: yes", "pack"), ("progress: Off", "progress"),
                                         ("compile: no", "compile"), ("progress: y", "progress"),
                                         ("model:\n  backward_encoder: off", "model.backward_encoder")])
def test_yaml_booleans_are_true_and_false_only(tmp_path, text, field):
    """YAML 1.1 read yes/no/on/off as booleans (`pack: on` trained packed, `--set pack=yes` too) while
    its numbers were already refused: booleans are YAML 1.2's, the rest is text the field refuses."""
    with pytest.raises(ValueError, match=f"config field '{re.escape(field)}' must be"):
        load(tmp_path, text + "\n")
    value = text.split(":")[-1].strip()
    with pytest.raises(ValueError, match=f"config field '{re.escape(field)}' must be"):
        apply_sets(TrainConfig(), [f"{field}={value}"])
    cfg = load(tmp_path, "pack: true\nprogress: False\ncompile: TRUE\n")
    assert (cfg.pack, cfg.progress, cfg.compile) == (True, False, True)
    assert apply_sets(TrainConfig(), ["pack=true", "progress=false"]).pack is True


@pytest.mark.parametrize("text, field", [("out_dir: 0.10", "out_dir"), ("data: 2024.10", "data"),
                                         ("data: 2024", "data"), ("tokenizer: 1", "tokenizer")])
def test_a_number_in_a_text_field_is_refused(tmp_path, text, field):
    """`out_dir: 0.10` was stored as '0.1' (the name as written lost): a number where a name is
    expected is refused, and quoted it is the name as written."""
    with pytest.raises(ValueError, match=f"'{field}' must be str, got the number .* \\(quote it"):
        load(tmp_path, text + "\n")
    name = text.split(": ")[1]
    assert getattr(load(tmp_path, f"{field}: '{name}'\n"), field) == name
    assert getattr(apply_sets(TrainConfig(), [f"{field}={name}"]), field) == name  # --set takes the text


@pytest.mark.parametrize("changes, field", [({"lr": "0.1"}, "lr"), ({"gamma": "0.5"}, "gamma"),
                                            ({"pairs": "0.5"}, "pairs"), ({"data": [["a", "0.5"]]}, "data")])
def test_a_string_in_a_number_field_is_refused(tmp_path, changes, field):
    """`steps: "5"` was refused but `lr: "0.1"` accepted: a float field takes a number, not text."""
    with pytest.raises(ValueError, match=f"'{field}' must be"):
        resolve_config(changes)
    (tmp_path / "c.json").write_text(json.dumps(changes))
    with pytest.raises(ValueError, match=f"'{field}' must be"):
        TrainConfig.load(tmp_path / "c.json")


def test_numbers_are_read_as_numbers_in_files_and_set(tmp_path):
    """Exponents without a dot are floats (YAML 1.2), in a file and in --set, as before."""
    cfg = load(tmp_path, "lr: 3e-4\nmin_lr: 1E-5\nweight_decay: 1e0\npairs: 5e-1\ndata: [[a, 5e-1]]\n")
    assert (cfg.lr, cfg.min_lr, cfg.weight_decay, cfg.pairs, cfg.data) == (3e-4, 1e-5, 1.0, 0.5, [["a", 0.5]])
    cfg = apply_sets(TrainConfig(), ["lr=0.1", "min_lr=1e-5", "pairs=2e-1", "gamma=1"])
    assert (cfg.lr, cfg.min_lr, cfg.pairs, cfg.gamma) == (0.1, 1e-5, 0.2, 1.0) and isinstance(cfg.gamma, float)


def test_a_json_config_with_a_byte_order_mark_loads(tmp_path):
    """A YAML file with a BOM loaded, the same JSON file was 'not valid JSON'."""
    (tmp_path / "c.json").write_bytes(b"\xef\xbb\xbf" + b'{"steps": 3}')
    (tmp_path / "c.yaml").write_bytes(b"\xef\xbb\xbf" + b"steps: 3\n")
    assert TrainConfig.load(tmp_path / "c.json").steps == TrainConfig.load(tmp_path / "c.yaml").steps == 3


@pytest.mark.parametrize("field", ["data", "out_dir"])
def test_an_empty_path_is_refused(tmp_path, monkeypatch, field):
    """Path("") is the current folder: `data: ""` trained on every *.txt there, `out_dir=""` wrote the
    run into it."""
    from bst_fast import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("some text " * 50)
    with pytest.raises(ValueError, match=f"'{field}' must be a non-empty path"):
        train(TINY, **{field: "", "steps": 1, **({"data": "notes.txt"} if field == "out_dir" else {})})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("changes, field, bound", [
    ({"star_nodes": 2**63}, "star_nodes", "2**31 - 1"), ({"batch_size": 2**63}, "batch_size", "2**31 - 1"),
    ({"n_test": 2**63}, "n_test", "2**31 - 1"), ({"n_train": 2**63}, "n_train", "2**31 - 1"),
    ({"steps": 2**31}, "steps", "2**31 - 1"),
    ({"model.head_hidden": 2**63}, "model.head_hidden", "2**31 - 1"),
    ({"model.head_hidden": [8, 2**63]}, "model.head_hidden", "2**31 - 1"),
    ({"model.head_layers": 2**63}, "model.head_layers", "2**31 - 1"),
    ({"model.n_layer": 2**63}, "model.n_layer", "2**31 - 1"),
    ({"model.d_model": 2**40, "model.n_head": 1}, "model.d_model", "2**24"),
])
def test_size_fields_have_an_upper_bound_naming_the_field(changes, field, bound):
    """star_nodes=2**63 raised 'Python int too large to convert to C long', batch_size=2**63 numpy's
    'Maximum allowed dimension exceeded', head_hidden a C++ frame dump, d_model=2**40 blamed mlp_ratio."""
    with pytest.raises(ValueError, match=f"config field '{re.escape(field)}' must be at most {re.escape(bound)} = "):
        resolve_config(TINY, **changes).check()
    ok = {k: (2**31 - 1 if k != "model.d_model" else 2**24) for k in changes if k != "model.n_head"}
    resolve_config(TINY, **ok)  # the bound itself is a valid value (whether it fits in memory is another matter)


def test_text_vocab_is_bounded_as_the_bpe_trainer_is():
    """text_vocab=10**9 reached HF tokenizers' trainer, which asked for 70 GB and aborted the process."""
    from bst_fast._checks import MAX_VOCAB
    text = dict(TEXT, data="corpus")
    with pytest.raises(ValueError, match=f"config field 'text_vocab' must be from 259 .* to {MAX_VOCAB} for text data"):
        resolve_config(text, text_vocab=MAX_VOCAB + 1).check()
    resolve_config(text, text_vocab=MAX_VOCAB).check()


@pytest.mark.parametrize("key, hint", [("n_layer", "model.n_layer"), ("d_model", "model.d_model"),
                                       ("vocab_size", "model.vocab_size"),
                                       # a level down and up, misspelt (helper-99: none, or 'model')
                                       ("n_layers", "model.n_layer"), ("dmodel", "model.d_model"),
                                       ("model.steps", "steps"), ("model.lr", "lr")])
def test_a_model_field_at_the_top_level_suggests_the_model_field(key, hint):
    """`n_layer: 2` suggested 'min_lr', `d_model` 'model', `vocab_size` 'batch_size'."""
    with pytest.raises(ValueError, match=f"'{key}' is unknown \\(did you mean '{hint}'\\?\\)"):
        resolve_config({key: 2})


def test_dotted_keys_in_a_file_are_the_nested_fields(tmp_path):
    """A dict config and --set took `model.n_layer`; a file said "did you mean 'model.min_lr'?; known
    fields of 'model': [the top-level list]"."""
    assert load(tmp_path, "model.n_layer: 2\nsteps: 3\n").model.n_layer == 2
    (tmp_path / "c.json").write_text('{"model.n_layer": 2, "model": {"d_model": 32}}')
    cfg = TrainConfig.load(tmp_path / "c.json")
    assert (cfg.model.n_layer, cfg.model.d_model) == (2, 32)
    with pytest.raises(ValueError, match="'model.n_layr' is unknown \\(did you mean 'model.n_layer'\\?\\); known "
                                         "fields of 'model': \\[.*'head_hidden'"):
        load(tmp_path, "model.n_layr: 2\n")


def test_numpy_scalars_and_paths_are_the_values_they_hold(tmp_path):
    """np.int64, np.float32 and np.bool_ were refused ('must be int, got np.int64(2)') and a Path for
    data or out_dir too, though a Path in a data list was taken."""
    cfg = resolve_config(TINY, steps=np.int64(2), lr=np.float32(0.5), progress=np.bool_(True), min_lr=np.float64(0.25),
                         data=tmp_path / "c.txt", out_dir=tmp_path / "run", pairs=np.float32(0.5),
                         **{"model.head_hidden": [np.int32(8), 4], "model.backward_encoder": np.bool_(False)})
    assert (cfg.steps, cfg.lr, cfg.progress, cfg.min_lr, cfg.pairs) == (2, 0.5, True, 0.25, 0.5)
    assert (cfg.data, cfg.out_dir, cfg.model.head_hidden) == (str(tmp_path / "c.txt"), str(tmp_path / "run"), [8, 4])
    assert [type(v) for v in (cfg.steps, cfg.lr, cfg.progress, cfg.min_lr, cfg.data, cfg.out_dir)] == \
        [int, float, bool, float, str, str]
    assert type(cfg.model.head_hidden[0]) is int and cfg.model.backward_encoder is False
    assert resolve_config(**{"model.head_hidden": (8,)}).model.head_hidden == [8]
    for bad in (["a"], [8.0], "8"):
        with pytest.raises(ValueError, match="'model.head_hidden' must be an int or a list of ints"):
            resolve_config(**{"model.head_hidden": bad})


def corpus(tmp_path):
    path = tmp_path / "c.txt"
    words = "the cat sat on a mat and ran to see the dog who barked at it".split()
    path.write_text("\n\n".join(" ".join(words[: 3 + (k * 7) % 13]) for k in range(50)))
    return str(path)


TEXT = dict(text_vocab=270, max_len=24, star_degree=2, star_path_len=5, star_nodes=50, n_test=500)  # star fields at defaults


@pytest.mark.parametrize("changes, field", [({"star_nodes": 99}, "star_nodes"), ({"n_test": 50}, "n_test"),
                                            ({"star_path_len": 3}, "star_path_len"), ({"n_train": 10}, "n_train"),
                                            ({"augment_prob": 0.2}, "augment_prob")])
def test_star_fields_on_a_text_run_are_refused(tmp_path, changes, field):
    """Text fields on a star run were refused, star fields on a text run accepted and ignored."""
    with pytest.raises(ValueError, match=f"'{field}' must be its default .* for text data"):
        resolve_config(TINY, **{**TEXT, "data": corpus(tmp_path), **changes}).check()


@pytest.mark.parametrize("method", ["forward", "teacherless", "fim", "augment"])
@pytest.mark.parametrize("changes, field", [({"pairs": 0.5}, "pairs"), ({"next_weight": 0.2}, "next_weight"),
                                            ({"gamma": 0.5}, "gamma"), ({"min_gap": 1, "meet_token": 10**6}, "min_gap"),
                                            ({"max_gap": 3}, "max_gap"), ({"meet_token": "eos"}, "meet_token")])
def test_objective_fields_on_a_method_that_does_not_read_them_are_refused(method, changes, field):
    """method=forward with pairs, next_weight, gamma, min_gap/meet_token or max_gap trained as without
    them (an out-of-vocabulary meet_token too; gamma > 0 saved model.gpt_head: true)."""
    with pytest.raises(ValueError, match=f"'{field}' must be its default .* for method '{method}'"):
        resolve_config(TINY, method=method, **changes).check()
    resolve_config(TINY, method=method, reduction="row_mean", augment_prob=0.2).check()  # left to every method


def test_star_trains_the_bst_objective_and_a_baseline_without_it(tmp_path, monkeypatch):
    """star trains every method from one config: a BST objective setting reaches the BST run and the
    forward-only run, which refuses it, trains without it."""
    import bst_fast.trainer as trainer
    from bst_fast import experiments

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: seen.append(cfg) or {"path_accuracy": 1.0, "loss": 0.0})
    cfg = resolve_config(TINY, out_dir=str(tmp_path), gamma=0.5, min_gap=1, meet_token="eos", pairs=0.5, next_weight=0.2,
                         **{"model.gpt_head": True})  # as a saved BST run's config holds it, set from gamma
    experiments.star(cfg)
    (bst, fwd), fields = seen, ("gamma", "min_gap", "meet_token", "pairs", "next_weight")
    assert [getattr(bst, f) for f in fields] == [0.5, 1, "eos", 0.5, 0.2]
    assert [getattr(fwd, f) for f in fields] == [getattr(TrainConfig(), f) for f in fields]


@pytest.mark.parametrize("kind", ["forward", "text"])
def test_a_run_saved_with_unread_fields_loads_and_resumes_without_them(tmp_path, monkeypatch, kind):
    """A run an earlier version trained with fields it does not read (pairs/gamma on forward, star_nodes on
    text) saved them in config.json: it still loads, and resumes from a config that leaves them out
    (they were "{'star_nodes': (50, 99)}" to resume)."""
    from bst_fast import config, load_model, train
    from bst_fast.checkpoint import latest_checkpoint

    base = dict(out_dir=str(tmp_path / "run"), steps=4, eval_every=0, ckpt_every=2)
    if kind == "forward":
        now, unread = dict(base, method="forward"), {"pairs": 0.5, "gamma": 0.5, "max_gap": 3}
    else:
        now, unread = dict(base, data=corpus(tmp_path), **TEXT), {"star_nodes": 99, "n_test": 7}
    with monkeypatch.context() as m:  # the earlier version: no refusal
        m.setattr(config, "BST_FIELDS", ())
        m.setattr(config, "STAR_FIELDS", ())
        train(TINY, stop_at=2, **{**now, **unread})
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-00000002" / "config.json").read_text())
    assert all(saved[k] == v for k, v in unread.items())
    model, cfg = load_model(tmp_path / "run")
    assert all(getattr(cfg, k) == v for k, v in unread.items())
    with pytest.raises(ValueError, match=f"'{next(iter(unread))}' must be its default"):
        train(TINY, resume=True, **{**now, **unread})
    train(TINY, resume=True, **now)
    assert latest_checkpoint(tmp_path / "run").name == "step-00000004"


def test_check_keeps_the_values_it_checked_so_the_run_can_save_them(tmp_path):
    """check() took numpy scalars and Paths but left them in the config: the whole run trained, then
    its first checkpoint failed ('Object of type float32 is not JSON serializable'; review helper-84)."""
    cfg = TrainConfig.load(TINY)
    cfg.lr, cfg.steps, cfg.progress, cfg.out_dir = np.float32(1e-3), np.int64(2), np.bool_(False), tmp_path / "run"
    cfg.model.n_layer = np.int64(1)
    cfg.check()
    assert (type(cfg.lr), type(cfg.steps), type(cfg.progress), cfg.out_dir) == (float, int, bool, str(tmp_path / "run"))
    assert type(cfg.model.n_layer) is int
    json.dumps(cfg.to_dict())  # what a checkpoint writes


def test_a_saved_config_past_todays_bounds_still_loads_but_a_new_run_is_bounded():
    """eval_every: 10**12 ('never'), saved by an older version, made the run's checkpoints
    'corrupt or unreadable' for load_model, generate and resume (review helper-84): the bound is a
    new run's check, not a saved config's reading."""
    saved = TrainConfig.from_dict({"eval_every": 10**12, "ckpt_every": 10**12})
    assert saved.eval_every == 10**12
    with pytest.raises(ValueError, match=r"config field 'eval_every' must be at most 2\*\*31 - 1"):
        saved.check()


@pytest.mark.parametrize("d, match", [
    ({"model": None, "model.n_layer": 2}, "config field 'model' must be a mapping, got None"),
    ({"model": 5, "model.n_layer": 2}, "config field 'model' must be a mapping, got 5"),
    ({"model": {"n_layer": 4}, "model.n_layer": 2}, "config field 'model.n_layer' is given twice"),
    ({"model.n_layer": 2, "model": {"n_layer": 4}}, "config field 'model.n_layer' is given twice"),
])
def test_a_nested_field_given_twice_or_under_a_non_mapping_is_refused(tmp_path, d, match):
    """model: null with model.n_layer was TypeError: 'NoneType' object does not support item
    assignment (exit 1); a field given in the mapping and as a dotted key took the later one."""
    with pytest.raises(ValueError, match=re.escape(match)):
        TrainConfig.from_dict(d)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=re.escape(match)):
        TrainConfig.load(path)


def test_a_whole_model_config_then_a_dotted_key_changes_that_field():
    """apply_overrides (a --set on a loaded config): the dotted key changes the field it names."""
    from bst_fast.config import apply_overrides
    from bst_fast.model import ModelConfig

    cfg = apply_overrides(TrainConfig(), {"model": ModelConfig(n_layer=2), "model.d_model": 32})
    assert (cfg.model.n_layer, cfg.model.d_model) == (2, 32)


def test_a_whole_model_config_and_a_dotted_key_are_refused_in_either_order():
    """A dotted key given before a whole ModelConfig was silently dropped (review helper-87)."""
    from bst_fast.model import ModelConfig

    for d in ({"model.n_layer": 2, "model": ModelConfig(n_layer=3)}, {"model": ModelConfig(n_layer=3), "model.n_layer": 2}):
        with pytest.raises(ValueError, match="config field 'model.n_layer' is given twice"):
            TrainConfig.from_dict(d)


def test_a_dict_config_and_keyword_overrides_refuse_a_field_given_twice():
    """train(dict) took {'model.n_layer': 2, 'model': {...}} last-wins, as from_dict refuses it (helper-99)."""
    from bst_fast.model import ModelConfig

    for config in ({"model.n_layer": 2, "model": {"n_layer": 4}}, {"model": {"n_layer": 4}, "model.n_layer": 2},
                   {"model.n_layer": 2, "model": ModelConfig(n_layer=3)}):
        with pytest.raises(ValueError, match="'model.n_layer' is given twice"):
            resolve_config(config)
    with pytest.raises(ValueError, match="'model.n_layer' is given twice"):
        resolve_config(None, model={"n_layer": 4}, **{"model.n_layer": 2})
    assert resolve_config({"model": {"n_layer": 4}, "model.d_model": 64}).model.n_layer == 4
    with pytest.raises(ValueError, match="a config is a mapping of fields, got list"):
        TrainConfig.from_dict([("steps", 1)])


@pytest.mark.parametrize("field", ["lr", "pairs", "model.mlp_ratio"])
def test_a_number_too_large_for_a_float_names_its_field(field):
    with pytest.raises(ValueError, match=f"config field '{field}' must be a number a float holds"):
        resolve_config(None, **{field: 10**400})
    with pytest.raises(ValueError, match=f"config field '{field}' must be a number a float holds"):
        apply_sets(TrainConfig(), [f"{field}={'1' * 400}"])
    with pytest.raises(ValueError, match="config field 'data' must be a number a float holds"):
        resolve_config(None, data=[["a", 10**400]])


def test_a_set_integer_of_too_many_digits_names_the_field():
    with pytest.raises(ValueError, match="--set 'steps': the number '1111.* has too many digits"):
        apply_sets(TrainConfig(), ["steps=" + "1" * 5000])


def test_an_empty_config_file_is_refused_and_a_yaml_date_is_told_to_be_quoted(tmp_path):
    for name, text in (("e.yaml", ""), ("e2.yaml", "# nothing\n"), ("n.json", "null")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="holds no fields"):
            TrainConfig.load(tmp_path / name)
    with pytest.raises(ValueError, match=r"'out_dir' must be str, got the date 2024-01-01 \(quote it"):
        load(tmp_path, "out_dir: 2024-01-01\n")


def test_the_command_line_takes_no_abbreviated_option(tmp_path, capsys):
    """`--o` was `--overwrite`, which deletes a run's files (helper-99)."""
    from bst_fast.__main__ import main

    for argv in (["train", "--config", str(TINY), "--o"], ["star", "--m", "forward"], ["table", "--n", "x"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_star_refuses_a_config_of_another_method(tmp_path):
    from bst_fast.experiments import star

    with pytest.raises(ValueError, match="config field 'method' is 'fim': star trains each of its methods"):
        star(resolve_config(TINY, method="fim", out_dir=str(tmp_path)))
