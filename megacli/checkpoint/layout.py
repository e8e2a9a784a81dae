"""Where things are in a megacli checkpoint directory.

    CKPT/latest              the name of the newest complete iteration
    CKPT/iter_0000100/       torch_dist shards + recipe.yaml + megacli.json (iteration, data position, layout)
    CKPT/hf/                 the tokenizer files (with the chat template a finetuned model was trained
                             with) and, in a converted checkpoint, its Hugging Face config; each
                             iteration's recipe.yaml names them relatively (megacli.checkpoint.carried)

A Megatron-LM torch_dist checkpoint (its default format; see megacli.checkpoint.megatron_lm.dist_reader):

    CKPT/latest_checkpointed_iteration.txt                   "1000" (or "release")
    CKPT/iter_0001000/.metadata, *.distcp, metadata.json, common.pt (Megatron-Core 0.16; from 0.19 on
                                                         the common state is inside the shards)

A Megatron-LM legacy (``--ckpt-format torch``) checkpoint:

    CKPT/latest_checkpointed_iteration.txt                   "1000" (or "release")
    CKPT/iter_0001000/mp_rank_TT/model_optim_rng.pt          pipeline size 1
    CKPT/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt      pipeline size > 1
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from megacli.errors import UserError
from megacli.paths import CHECKPOINT_RECORD, with_carried_tokenizer

LATEST = "latest"
META = CHECKPOINT_RECORD
RECIPE = "recipe.yaml"
BACKEND_META = "metadata.json"  # Megatron-Core's dist_checkpointing config: {"sharded_backend": "torch_dist", ...}
HF_DIR = "hf"
HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG, "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", CHAT_TEMPLATE_FILE,
                   "chat_template.json")
CARRIED_FILES = (*TOKENIZER_FILES, HF_CONFIG, GENERATION_CONFIG)  # what a checkpoint's hf/ may hold


def from_iteration(name: str = HF_DIR) -> str:
    """How an iteration's recipe.yaml names ``name`` beside the iterations (CKPT/hf: ``../hf``)."""
    return f"../{name}"
TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?\Z")


def iter_name(iteration: int) -> str:
    """The directory name of an iteration, in megacli and Megatron-LM checkpoints alike."""
    return f"iter_{iteration:07d}"


def find_checkpoint(path: str | Path) -> Path | None:
    """A checkpoint directory from a run directory (via `latest`) or an iteration directory itself;
    None when ``path`` holds neither."""
    path = Path(path)
    if (path / META).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        target = path / pointer.read_text().strip()
        if (target / META).is_file():
            return target
        raise UserError(f"{pointer} names {target.name}, which is not a complete checkpoint")
    return None


def read_meta(ckpt: Path) -> dict:
    try:
        meta = json.loads((ckpt / META).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{ckpt / META}: cannot read ({exc})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{ckpt / META}: not a checkpoint record (a JSON object)")
    return meta


def read_recipe(ckpt: Path) -> dict:
    """The raw recipe a checkpoint carries (an empty dict when it has none), without the trust it
    claims (megacli.recipe.trust)."""
    import yaml

    from megacli.recipe import trust
    from megacli.recipe.yaml_text import load_yaml_text, yaml_problem

    path = ckpt / RECIPE
    if not path.is_file():
        return {}
    try:
        recipe = load_yaml_text(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: cannot read ({yaml_problem(exc)})") from None
    if not isinstance(recipe, dict):
        raise UserError(f"{path}: not a recipe (a mapping of sections)")
    return with_carried_tokenizer(ckpt, trust.carried(recipe))


def lora_base_of(ckpt: Path) -> Path | None:
    """The base checkpoint of a LoRA run's checkpoint (which holds adapters only), else None."""
    if not (ckpt / META).is_file():  # another writer's checkpoint (Megatron-LM's): full weights
        return None
    lora = read_meta(ckpt).get("lora") or {}
    base = lora.get("base") if isinstance(lora, dict) else None
    if base is None:
        return None
    if not isinstance(base, str):
        raise UserError(f"{ckpt / META}: lora.base = {base!r} is not a path")
    found = find_checkpoint(base) if Path(base).exists() else None
    if found is None:
        raise UserError(f"{ckpt} holds LoRA adapters for the base checkpoint {base}, which is not there any more")
    return found


def carried_hf_dir(ckpt: Path, tokenizer_path: str | None) -> Path | None:
    """The source HF config a converted checkpoint carries (CKPT/../hf), or the tokenizer directory
    when it holds a config.json."""
    candidates = [ckpt.parent / HF_DIR]
    if tokenizer_path:
        tok = Path(tokenizer_path)
        candidates.append(tok if tok.is_dir() else tok.parent)
    return next((c for c in candidates if (c / HF_CONFIG).is_file()), None)


def carried_hf_config(ckpt: Path, recipe) -> dict | None:
    """The Hugging Face config.json a converted checkpoint carries, None for other checkpoints."""
    from megacli.checkpoint.hf_config import read_config

    carried = carried_hf_dir(ckpt, recipe.tokenizer.path)
    return read_config(carried / HF_CONFIG) if carried is not None else None


def tmp_sibling(path: Path, tag: str) -> Path:
    """A hidden sibling of ``path`` to build it in before renaming it into place."""
    return path.parent / f".{path.name}.{tag}-tmp"


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (what was renamed into it) to disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- Megatron-LM torch_dist


def is_torch_dist_iteration(path: Path) -> bool:
    """An iteration directory Megatron-LM wrote with torch_dist: DCP metadata with common.pt or
    Megatron-Core's metadata.json (from 0.19 on its common state is inside the shards, and there is
    no common.pt), and no megacli.json (megacli's own checkpoints have that)."""
    return ((path / ".metadata").is_file() and ((path / "common.pt").is_file() or (path / BACKEND_META).is_file())
            and not (path / META).is_file())


def tracked_iteration(root: Path) -> Path | None:
    """The iteration directory a tracker file names (None when ``root`` has no tracker file)."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    name = "release" if text == "release" else iter_name(int(text)) if text.isdigit() else None
    if name is None or not (root / name).is_dir():
        raise UserError(f"{tracker} says {text!r}, but there is no matching iteration directory")
    return root / name


def is_megatron_lm_dir(path: Path) -> bool:
    """A Megatron-LM torch_dist checkpoint: a root whose tracker names a torch_dist iteration, or
    such an iteration directory itself."""
    if not path.is_dir():
        return False
    if (path / TRACKER).is_file():
        try:
            it = tracked_iteration(path)
        except UserError:
            return False
        return it is not None and is_torch_dist_iteration(it)
    return is_torch_dist_iteration(path)


# ---------------------------------------------------------------- Megatron-LM legacy


def is_legacy_dir(path: Path) -> bool:
    """A Megatron-LM legacy checkpoint root (its tracker file) or iteration directory (mp_rank_*)."""
    if is_megatron_lm_dir(path):
        return False
    return (path / TRACKER).is_file() or any(RANK_DIR.match(p.name) for p in _subdirs(path))


def _subdirs(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.is_dir()] if path.is_dir() else []


def iteration_dir(path: Path) -> Path:
    """The iteration directory (holding mp_rank_*) of a legacy checkpoint root or iteration dir."""
    return tracked_iteration(path) or path


def rank_files(it_dir: Path) -> dict[tuple[int, int], Path]:
    """(tp rank, pp rank) -> model_optim_rng.pt."""
    files = {}
    for d in _subdirs(it_dir):
        m = RANK_DIR.match(d.name)
        if not m:
            continue
        if m.group(3):
            raise UserError(f"{d}: expert-parallel (MoE) legacy checkpoints are not supported")
        f = d / FILE
        if not f.is_file():
            raise UserError(f"{d} has no {FILE}")
        files[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not files:
        raise UserError(f"{it_dir}: no mp_rank_* directories (not a Megatron-LM legacy checkpoint)")
    tps = sorted({t for t, _ in files})
    pps = sorted({p for _, p in files})
    missing = [f"mp_rank_{t:02d}_{p:03d}" for t in tps for p in pps if (t, p) not in files]
    if missing or tps != list(range(len(tps))) or pps != list(range(len(pps))):
        raise UserError(f"{it_dir}: incomplete set of rank directories (missing {', '.join(missing) or 'ranks'})")
    return files
