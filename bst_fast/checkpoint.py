"""bst_fast.checkpoint: checkpoints that are complete, verified and never lost to pruning.

A checkpoint is out_dir/checkpoints/step-N/ (N zero-padded to at least 8 digits) holding
model.safetensors, state.pt (optimizer, scheduler, the open logging interval), config.json, the
task's files (a text run's tokenizer.json and data.json) and checksums.json: the sha256 of every
other file. It is written under a temporary name unique to the process, synced, and renamed into
place; then `latest` is replaced atomically to name it. Loading checks every checksum, that the
weights are finite and that the optimizer state fits the model, so a damaged checkpoint is an
error, never a silently wrong run.
"""
from __future__ import annotations

import errno
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
import re
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ._checks import ArgumentTypeError, short
from .config import EVALUATION_CHANGES, SAME_TRAJECTORY_CHANGES, TrainConfig, config_changes
from .data.corpus_layout import is_prepared
from .files import CORPUS, TOKENIZER, OUT_OF_ROOM, atomic_write, fsync, out_of_room, sha256, sha256_written, start_writeback, temporary_name

CHECKSUMS = "checksums.json"
BEST, BEST_JSON = "best", "best.json"  # the best checkpoint by the evaluation metric (keep_best)
WEIGHTS, STATE, CONFIG = "model.safetensors", "state.pt", "config.json"
STEP_NAME = re.compile(r"step-(\d{8,})")  # what `latest` may name: a checkpoint in checkpoints/
# save_checkpoint's temporary names (files.temporary_name: `.<name>.<pid>.tmp`), the only names a
# start may delete from checkpoints/: a user's own `.x.tmp` there is not ours
OWN_TEMPORARY = re.compile(r"\.(step-\d{8,}|latest|best|best-old)\.\d+\.tmp")


class NonFiniteWeights(ValueError):
    """A model holds NaN or infinite weights: they are never saved (nor loaded)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a read-only folder); the previous one is intact."""


def checkpoint_step(path: Path) -> Optional[int]:
    """N of a folder named step-N, else None."""
    m = STEP_NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def _unshared(state):
    """The state dict on the CPU with a copy of every tensor whose storage an earlier one already
    holds (a tied head and embedding): safetensors refuses tensors that share memory."""
    out, seen = {}, set()
    for k, v in state.items():
        v = v.detach().contiguous().cpu()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def non_finite(tensors: Dict[str, torch.Tensor]) -> List[str]:
    """The names of the floating-point tensors that hold a NaN or an infinity."""
    floats = {k: v for k, v in tensors.items() if v.is_floating_point()}
    # One fused call instead of an isfinite pass per tensor (0.6 ms instead of 3-4 ms at star_cpu): a
    # tensor's 2-norm is NaN or infinite whenever one of its values is. A finite tensor's norm can
    # still overflow (float32 values beyond ~1e19), so a non-finite norm is checked value by value.
    if not floats or bool(torch.stack(torch._foreach_norm(list(floats.values()))).isfinite().all()):
        return []
    return [k for k, v in floats.items() if not bool(torch.isfinite(v).all())]


def save_checkpoint(out_dir, step, model, optimizer, scheduler, cfg: TrainConfig, keep: int, log=None,
                    task=None, best: Optional[dict] = None, logged: Optional[int] = None) -> Path:
    """out_dir/checkpoints/step-N, then `latest` names it, then older checkpoints beyond `keep` are
    pruned. `log`: the logging interval still open at `step` (each rank's loss sum and the steps in
    it), when the run stops between two logged steps; `logged`: how many steps metrics.csv has rows
    for (a resume checks that none went missing); `task`: writes its files (a text run's
    tokenizer) into the checkpoint. `best`: {"metric", "value", "step", "world"} saves the run's best
    checkpoint instead, checkpoints/best (best.json records the figure), which `latest` never names
    and pruning never touches.

    Non-finite weights are refused (NonFiniteWeights, a ValueError) before the checkpoint is put in
    place. A failed write (a full disk) removes the partial folder and raises CheckpointWriteError;
    `latest` still names the previous checkpoint."""
    from safetensors.torch import save_file

    weights = _unshared(model.state_dict())
    root = Path(out_dir) / "checkpoints"
    final = root / (BEST if best else f"step-{step:08d}")
    tmp = temporary_name(final)
    pool, committed = None, False
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(weights, str(tmp / WEIGHTS))
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "log": log, "logged": logged}, tmp / STATE)
        (tmp / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))
        if task is not None:
            task.save(tmp)
        if best:
            (tmp / BEST_JSON).write_text(json.dumps(best, indent=1))
        # The verification (~10 ms of CPU at star_cpu: sha256 of 10 MB, the finiteness check) runs while
        # the disk writes the big files (~9 ms), which it is first asked to start: the fsyncs below
        # then wait only for what is left. The weights are hashed on a second thread (a second core,
        # when one is free). Measured slower: hashing on threads beside the pickling (they fight it for
        # the GIL and the core) or while this thread sat in fsync (it then started the disk late).
        for name in (WEIGHTS, STATE):
            start_writeback(tmp / name)
        pool = ThreadPoolExecutor(1)
        weights_sum = pool.submit(sha256_written, tmp / WEIGHTS)
        # AdamW's moments are checked too (loading refuses them, so a saved one would prune the last
        # usable checkpoint), on the second thread after the weights' hash: the two threads' shares
        # then come out about even (~4 and ~7 ms at star_cpu)
        moments_bad = pool.submit(non_finite, _optimizer_tensors(optimizer))
        bad = non_finite(weights)
        if bad:
            raise NonFiniteWeights(f"refusing to save a checkpoint at step {step}: non-finite values in {bad[:5]}")
        state_sum = sha256_written(tmp / STATE)
        bad = moments_bad.result()
        if bad:
            raise NonFiniteWeights(f"refusing to save a checkpoint at step {step}: non-finite optimizer state "
                                   f"in {bad[:5]}")
        sums = {STATE: state_sum, WEIGHTS: weights_sum.result()}
        sums.update((path.name, sha256_written(path)) for path in tmp.iterdir() if path.name not in sums)
        (tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True))
        for path in (*tmp.iterdir(), tmp):  # on disk before the rename makes them the checkpoint
            fsync(path)
        if best:  # the old best goes only once the new one is complete
            old = temporary_name(root / "best-old")
            moved = final.exists()
            if moved:
                os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                if moved:  # the old best back in its place (or, failing that, by remove_stale at the next start)
                    try:
                        os.replace(old, final)
                    except OSError:
                        pass
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            atomic_write(root / "latest", lambda p: p.write_text(final.name))
        committed = True  # in place; what may fail now is making the folder's renames durable
        fsync(root)
    except NonFiniteWeights:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # torch.save and safetensors report a short write as their own errors
        room = out_of_room(e) or _room_left(root, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(_write_failure(root, step, e, room, final, committed)) from e
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    if not best:
        prune(root, final, keep)
    return final


def resume_changes(then: dict, now: dict, allowed) -> dict:
    """config_changes(then, now, allowed) for a resume (the trainer's check of the checkpoint it
    continues from, best_so_far's of the best checkpoint): one rule for both. A text run's `data`
    may name its corpus by another path (a link, a moved folder): not compared here, the task
    compares the corpus itself with the checkpoint's fingerprint (its data.json). `text_vocab` is
    read only to train a BPE of raw text: a run whose tokenizer came with it (a `tokenizer` file,
    a prepared corpus) never read it, so there it is no difference."""
    text = then.get("data") != "star" and now["data"] != "star"
    # a resume reads the tokenizer its checkpoint carries: the task compares a named one's content
    allowed = tuple(allowed) + (("data", "tokenizer") if text else ())
    if text and (then.get("tokenizer") or not isinstance(now["data"], str) or is_prepared(now["data"])):
        allowed += ("text_vocab",)
    return config_changes(then, now, allowed)


def best_so_far(out_dir, metric: str, step: int, cfg: TrainConfig, world: int = 1) -> Optional[float]:
    """The figure of out_dir's best checkpoint for `metric`, for a run (config `cfg`, `world` ranks)
    resumed from `step`, or None. A best saved after `step` counts when its config is cfg but for
    changes that leave the trajectory as it was (SAME_TRAJECTORY_CHANGES: the resume retraces the
    steps that made it; dropping it let a worse figure replace it) and it was made by as many ranks
    (best.json's "world"; another count sums the batch in another order); otherwise it belongs to
    a trajectory the resume replaces. A best whose evaluation scored other held-out rows
    (eval_batches) never counts. A best.json that fails its checksum or holds no finite figure is named on stderr and
    counts as none (a new best replaces it)."""
    best = Path(out_dir) / "checkpoints" / BEST
    if not (best / BEST_JSON).is_file():
        return None
    try:
        verify(best, only=BEST_JSON)
        saved = json.loads((best / BEST_JSON).read_text())
        value, saved_step = float(saved["value"]), int(saved["step"])
        if not math.isfinite(value):
            raise ValueError(f"its figure is {value}")
        if saved["metric"] != metric:
            return None
        verify(best, only=CONFIG)
        then, now = TrainConfig.from_dict(json.loads((best / CONFIG).read_text())).to_dict(), cfg.to_dict()
        if any(then[k] != now[k] for k in EVALUATION_CHANGES):  # its figure scored other rows
            return None
        if saved_step > step:
            if resume_changes(then, now, SAME_TRAJECTORY_CHANGES):
                return None
            made_by = saved.get("world", world)  # a best.json from before stop 42 holds none
            if isinstance(made_by, bool) or not isinstance(made_by, int) or made_by < 1:
                raise ValueError(f"its world is {made_by!r}, not a number of ranks")
            if made_by != world:
                return None
        return value
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"warning: the best checkpoint {best} has a damaged {BEST_JSON} or {CONFIG} ({short(str(e), 300)}); "
              f"the next evaluation's checkpoint replaces it", file=sys.stderr, flush=True)
        return None


def _room_left(root: Path, tmp: Path) -> Optional[str]:
    """OUT_OF_ROOM's text where the disk under `root` is (nearly) full or a file in `tmp` reached the
    process's file-size limit (ulimit -f), else None: the C++ writers of torch.save and safetensors
    lose the errno."""
    import resource

    try:
        if shutil.disk_usage(root).free <= 1 << 20:
            return OUT_OF_ROOM[errno.ENOSPC]
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and any(p.stat().st_size >= limit - (1 << 16) for p in tmp.iterdir()):
            return OUT_OF_ROOM[errno.EFBIG]
    except OSError:
        pass
    return None


def _write_failure(root: Path, step: int, error: BaseException, room: Optional[str], final: Path,
                   committed: bool) -> str:
    """The message of a failed save of `final` (checkpoints/step-N or checkpoints/best): what is
    left to load. `room`: what ran out (out_of_room), if that was the cause. `committed`: the
    checkpoint was in place when the folder's fsync failed."""
    cause = room or f"{type(error).__name__}: {short(str(error), 300)}"
    if committed:
        return (f"the checkpoint of step {step}, {final}, is written and in place, but its folder {root} could not "
                f"be synced to disk ({cause}): a crash now may lose it")
    if final.name == BEST:
        kept = sorted(root.glob(".best-old.*.tmp"))
        previous = final if final.is_dir() else None
        kind = "best checkpoint"
        if previous is None and kept:
            return (f"could not write the best checkpoint of step {step} under {root}: {cause}; the previous best "
                    f"checkpoint is kept as {kept[0]}, and the run's next start puts it back")
    else:
        try:
            previous = latest_checkpoint(root.parent)
        except ValueError:
            previous = None
        kind = "checkpoint"
        if previous == final:  # in place, `latest` not written: the fallback of latest_checkpoint finds it
            return (f"the checkpoint of step {step}, {final}, is complete and in place, but {root / 'latest'} could "
                    f"not be written ({cause}); a resume takes that checkpoint")
    return (f"could not write the {kind} of step {step} under {root}: {cause}; "
            f"{f'the previous {kind} {previous} is intact' if previous else f'no earlier {kind} exists'}")


def prune(root: Path, newest: Path, keep: int):
    """Deletes checkpoints beyond the `keep` newest by step (`newest` among them, the one `latest`
    now names); checkpoints of later steps than `newest` are orphans of an interrupted run whose
    trajectory this one replaced, and go too. keep=0 keeps every checkpoint."""
    if not keep:
        return
    now = checkpoint_step(newest)
    older = sorted((p for p in root.iterdir() if p.is_dir() and p != newest and checkpoint_step(p) is not None),
                   key=checkpoint_step)
    doomed = [p for p in older if checkpoint_step(p) > now]
    kept = [p for p in older if checkpoint_step(p) < now]
    doomed += kept[:max(len(kept) - (keep - 1), 0)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale(root: Path):
    """Temporary folders and files of a crashed or killed save (their process is gone: the caller
    holds the run folder's lock), by save_checkpoint's own names only. A save of `best` killed
    between its two renames left no `best` and the previous one as `.best-old.<pid>.tmp`: that one
    is put back (the run resumes from a `latest` older than the new best, and evaluates it again)."""
    if not root.is_dir() or root.is_symlink():
        return
    for path in sorted(root.iterdir()):
        if not OWN_TEMPORARY.fullmatch(path.name):
            continue
        real_dir = path.is_dir() and not path.is_symlink()
        if real_dir and path.name.startswith(".best-old.") and not os.path.lexists(root / BEST):
            os.replace(path, root / BEST)
        elif real_dir:
            shutil.rmtree(path)
        else:
            path.unlink()


def latest_checkpoint(out_dir) -> Optional[Path]:
    """The checkpoint out_dir/checkpoints/latest names. A `latest` that is not a file, names anything
    but a step-N folder of checkpoints/, or names a missing one is a ValueError. Without a `latest`:
    the newest step-N folder with its checksums (a save killed between putting its folder in place
    and writing the run's first `latest` left one; resume refused it as "no checkpoint" while a new
    start was refused as a run to resume), else None."""
    latest = Path(out_dir) / "checkpoints" / "latest"
    if not latest.exists() and not latest.is_symlink():
        found = [p for p in latest.parent.glob("step-*") if checkpoint_step(p) is not None and p.is_dir()
                 and not p.is_symlink() and (p / CHECKSUMS).is_file()] if latest.parent.is_dir() else []
        return max(found, key=checkpoint_step, default=None)
    try:
        name = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{latest} is unreadable ({type(e).__name__}: {short(str(e))}): it should hold the name "
                         f"of a checkpoint folder") from None
    if latest.is_symlink() or not STEP_NAME.fullmatch(name):
        raise ValueError(f"{latest} must name a checkpoint folder step-N of {latest.parent}, got {short(name)}")
    path = latest.parent / name
    if not path.is_dir() or path.is_symlink():
        raise ValueError(f"checkpoint {path} named by {latest} is missing")
    return path


def _checksums(path: Path) -> Dict[str, str]:
    """A checkpoint's checksums.json (file name -> sha256), or a ValueError saying why not."""
    try:
        sums = json.loads((path / CHECKSUMS).read_text())
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} has no {CHECKSUMS}: it is unfinished, or written by an "
                         f"older bst_fast without checksums, and is not used") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path} has a damaged {CHECKSUMS}: {short(str(e))}") from None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise ValueError(f"checkpoint {path} has a damaged {CHECKSUMS}: not a mapping of file names to sha256")
    return sums


def verify(path: Path, only: Optional[str] = None) -> Dict[str, str]:
    """Checks every file of a checkpoint (or the one named `only`, which must be listed) against its
    checksums.json; the checksums, or a ValueError naming what is missing or damaged."""
    path = Path(path)
    sums = _checksums(path)
    for name in (WEIGHTS, STATE, CONFIG) if only is None else (only,):
        if name not in sums:
            raise ValueError(f"checkpoint {path}: {CHECKSUMS} does not list {name}")
    for name in (TOKENIZER, CORPUS) if only is None else ():  # read by a resume when present: never unchecked
        if name not in sums and (path / name).exists():
            raise ValueError(f"checkpoint {path} holds {name}, which its {CHECKSUMS} does not list: it was added "
                             "or replaced after the checkpoint was saved")
    for name, want in sums.items() if only is None else [(only, sums[only])]:
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise ValueError(f"checkpoint {path} is missing {short(name)}, which its {CHECKSUMS} lists")
        if sha256(file) != want:
            raise ValueError(f"checkpoint {path} is corrupt: {name} does not match its sha256 in {CHECKSUMS}")
    return sums


def read_config(path: Path) -> TrainConfig:
    """The TrainConfig a checkpoint was trained with (its checksums checked first)."""
    verify(path)
    try:
        return TrainConfig.from_dict(json.loads((Path(path) / CONFIG).read_text()))
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {path} has a corrupt or unreadable {CONFIG}: {short(str(e), 300)}") from None


def load_checkpoint(path, model, optimizer=None, scheduler=None, verified: bool = False):
    """Loads weights (and optimizer and scheduler) after checking the checksums (unless `verified`:
    the caller just did), that every weight is finite and that shapes match the model; a damaged or
    mismatched checkpoint raises ValueError. Returns the training state: {"step": N, "log": the open
    logging interval or None, "logged": the count of logged steps or None} ({"step": 0} without an
    optimizer)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not verified:
        verify(path)
    try:
        weights = load_file(str(path / WEIGHTS))
    except Exception as e:  # safetensors raises several types for a damaged file
        raise ValueError(f"checkpoint {path} is corrupt or unreadable: {short(str(e), 300)}") from e
    bad = non_finite(weights)
    if bad:
        raise ValueError(f"checkpoint {path} holds non-finite weights (NaN or inf) in {bad[:5]}: it is not used")
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [k for k in own if k in weights and own[k].shape != weights[k].shape]
    # a dtype the run never saves (fp16 weights of a float32 model) would be cast on load, silently
    dtypes = [(k, str(weights[k].dtype), str(own[k].dtype)) for k in own if k in weights and own[k].dtype != weights[k].dtype]
    if missing or extra or shapes or dtypes:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, shape mismatch {[(k, tuple(weights[k].shape), tuple(own[k].shape)) for k in shapes[:5]]}"
                         + (f", dtype mismatch {dtypes[:5]}" if dtypes else ""))
    # Names of one tied tensor (the SwiGLU head's lm_head and the token embedding) must be saved
    # equal: loading writes them all into one Parameter, and the last one would silently win.
    tied = {}
    for k, v in own.items():
        if v.numel():
            tied.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), v.shape), []).append(k)
    for names in tied.values():
        if any(not torch.equal(weights[names[0]], weights[k]) for k in names[1:]):
            raise ValueError(f"checkpoint {path} holds different values for {names}, which this model ties into "
                             f"one tensor: it was not trained with the tie (model.head_tie_embedding)")
    model.load_state_dict(weights)
    state = {"step": 0}
    if optimizer is not None:
        try:
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
        except Exception as e:
            raise ValueError(f"checkpoint {path} has a corrupt or mismatched {STATE}: {short(str(e), 300)}") from e
        _check_optimizer_state(path, optimizer)
        step, named = state.get("step"), checkpoint_step(path)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint {path} has a corrupt {STATE}: its step must be an int >= 0, "
                             f"got {short(repr(step))}")
        logged = state.get("logged")  # absent from checkpoints of older versions
        if logged is not None and (not isinstance(logged, int) or isinstance(logged, bool) or not 0 <= logged <= step):
            raise ValueError(f"checkpoint {path} has a corrupt {STATE}: its count of logged steps must be an int "
                             f"in [0, step {step}], got {short(repr(logged))}")
        log = state.get("log")  # the open logging interval: every rank's loss sum and the steps in it
        if log is not None and not (isinstance(log, dict) and isinstance(log.get("loss_sum"), list) and log["loss_sum"]
                                    and all(isinstance(x, float) for x in log["loss_sum"])
                                    and isinstance(log.get("n"), int) and not isinstance(log["n"], bool)
                                    and 0 <= log["n"] <= step):
            raise ValueError(f"checkpoint {path} has a corrupt {STATE}: its open logging interval must be None or "
                             f"{{'loss_sum': [a float per rank], 'n': steps in [0, {step}]}}, got {short(repr(log))}")
        if named is not None and step != named:
            raise ValueError(f"checkpoint {path} records step {step} in {STATE} but is named for step {named}: "
                             f"files of two checkpoints were mixed; it is not used")
    return state


def _optimizer_tensors(optimizer) -> Dict[str, torch.Tensor]:
    """The optimizer's per-parameter state tensors (AdamW's moments), named `<param index>.<name>`."""
    return {f"{k}.{name}": v for k, st in enumerate(optimizer.state.values())
            for name, v in st.items() if torch.is_tensor(v) and v.dim() > 0}


def _check_optimizer_state(path: Path, optimizer):
    """AdamW's moments must have their parameter's shape and be finite: load_state_dict accepts any
    tensors, and a mismatch would only fail (or silently broadcast) at the first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, v in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(v) or v.dim() == 0:
                    continue
                if v.shape != p.shape:
                    raise ValueError(f"checkpoint {path} has a mismatched {STATE}: optimizer state {name!r} of shape "
                                     f"{tuple(v.shape)} for a parameter of shape {tuple(p.shape)}")
                if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    raise ValueError(f"checkpoint {path} holds non-finite optimizer state ({name!r}): it is not used")


class CheckpointNotFound(FileNotFoundError, ValueError):
    """No file or folder at a checkpoint's path: a FileNotFoundError, as every other loader here
    raises for a missing path, and a ValueError, as this one raised before."""


def find_checkpoint(path) -> Path:
    """A checkpoint folder, or a run folder's latest checkpoint; CheckpointNotFound where nothing is
    at `path`, ValueError where it is neither."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path must be a checkpoint or run folder (a str or a path), got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFound(f"checkpoint {path} does not exist")
    if (path / CONFIG).exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"{path} is neither a checkpoint folder nor a run folder with checkpoints")
    return found


def load_model(path, device="cpu"):
    """(model, TrainConfig) from a checkpoint folder (or a run folder, taking its latest checkpoint),
    its checksums and weights checked; the model in eval mode (dropout off), to decode or evaluate.
    device: a torch device, or "auto" (CUDA where torch sees it, as the config's `device` takes it)."""
    from .tasks import build_model

    if device is None or device == "auto":  # None: where the model is built (the CPU), as .to(None) left it
        device = "cpu" if device is None or not torch.cuda.is_available() else "cuda"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto' or a torch device ('cpu', 'cuda', 'cuda:1'), got {short(device)}") from None
    path = find_checkpoint(path)
    cfg = read_config(path)
    model = build_model(cfg).to(device)
    load_checkpoint(path, model, verified=True)
    return model.eval(), cfg
