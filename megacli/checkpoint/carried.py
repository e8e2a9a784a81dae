"""The tokenizer a megacli checkpoint carries: its files (and the chat template a finetuned model
was trained with) in ``CKPT/hf/`` beside the iteration directories, once per checkpoint directory,
as a converted checkpoint carries its source's Hugging Face files there. Each iteration's
recipe.yaml names it relatively (``tokenizer.path: ../hf``, or ``../hf/tokenizer.model`` for a
file), so the checkpoint directory can be moved or copied whole.

When ``CKPT/hf`` already holds other files (a run saving into a converted checkpoint's directory
with another tokenizer or template), the tokenizer goes to ``CKPT/hf-<digest>`` instead: a
checkpoint never changes what an older iteration's recipe names.

Reading: wherever a checkpoint's recipe.yaml is read (``layout.read_recipe``, ``recipe.base.read_yaml``),
``megacli.paths.with_carried_tokenizer`` resolves its relative tokenizer.path against the iteration
directory when it is there (checkpoints written before megacli carried its tokenizer named it
relative to the working directory, which is where it is looked for then)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from megacli.checkpoint.layout import (CARRIED_FILES, CHAT_TEMPLATE_FILE, HF_DIR, TOKENIZER_CONFIG, TOKENIZER_FILES,
                                      from_iteration, fsync_dir, tmp_sibling)

STAGE_TAG = "carry"


def _files_of(tokenizer) -> tuple[Path, list[str], str | None] | None:
    """Where a tokenizer section's files are, the names to carry from there, and the file the
    section names (None when it names a directory); None when it names nothing that is here."""
    if not tokenizer.path or tokenizer.type == "none":
        return None
    path = Path(os.path.expanduser(tokenizer.path))
    if not path.exists():  # nothing to copy (reshard of a checkpoint whose tokenizer is not here): named as it was
        return None
    folder = path if path.is_dir() else path.parent
    names = [name for name in CARRIED_FILES if (folder / name).is_file()]
    file = None if path.is_dir() else path.name
    if file is not None and file not in names:
        names.append(file)
    return folder, names, file


def _carried_by(root: Path, path: str | None) -> bool:
    """``path`` names, as an iteration's recipe.yaml does, what ``root`` already carries."""
    parts = Path(path).parts if path else ()
    return len(parts) >= 2 and parts[0] == ".." and parts[1].startswith(HF_DIR) and (root.joinpath(*parts[1:])).exists()


def write_chat_template(folder: Path, template: str, *, huggingface: bool) -> None:
    """``template`` as the tokenizer's chat template: in tokenizer_config.json for a Hugging Face
    tokenizer (other template files removed: transformers prefers them), else chat_template.jinja."""
    for other in (CHAT_TEMPLATE_FILE, "chat_template.json"):
        (folder / other).unlink(missing_ok=True)
    if not huggingface:
        (folder / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
        return
    config_file = folder / TOKENIZER_CONFIG
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    config["chat_template"] = template
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _place(root: Path, staged: Path) -> str:
    """Move the staged tokenizer directory into ``root`` (as hf, or hf-<digest> when hf holds other
    files); the name it has there."""
    target = root / HF_DIR
    if target.is_dir() and _digest(target) == _digest(staged):
        shutil.rmtree(staged)
        return HF_DIR
    if target.exists():
        name = f"{HF_DIR}-{_digest(staged)[:12]}"
        target = root / name
        if target.exists():  # the same digest: the same files
            shutil.rmtree(staged)
            return name
    os.replace(staged, target)
    fsync_dir(root)
    return target.name


def carry(root: Path, tokenizer, *, chat_template: str | None = None) -> dict:
    """Copy the tokenizer of ``tokenizer`` (a TokenizerSection) into checkpoint directory ``root``,
    with ``chat_template`` (Jinja) written into its config; return the section its iterations'
    recipe.yaml holds. Built beside its place and renamed into it: never half-written."""
    section = tokenizer.model_dump()
    if chat_template is None and _carried_by(root, tokenizer.path):
        return section
    found = _files_of(tokenizer)
    if found is None and (chat_template is None or tokenizer.type not in ("byte", "none")):
        return section
    root.mkdir(parents=True, exist_ok=True)
    staged = tmp_sibling(root / HF_DIR, STAGE_TAG)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    try:
        folder, names, file = found or (None, [], None)
        for name in names:
            shutil.copy2(folder / name, staged / name)
        if chat_template is not None:
            write_chat_template(staged, chat_template, huggingface=tokenizer.type == "huggingface")
        name = _place(root, staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    section["path"] = from_iteration(name) + (f"/{file}" if file else "")
    return section


def same_tokenizer(a: str | None, b: str | None) -> bool:
    """Two tokenizer paths that hold the same tokenizer files (a run's own and the copy its
    checkpoint carries)."""
    if a == b:
        return True
    if not (isinstance(a, str) and isinstance(b, str) and a and b):
        return False
    pa, pb = Path(a), Path(b)
    if not (pa.exists() and pb.exists()) or pa.is_dir() != pb.is_dir():
        return False
    if not pa.is_dir():
        return pa.read_bytes() == pb.read_bytes()
    names = [n for n in TOKENIZER_FILES if n not in (CHAT_TEMPLATE_FILE, "chat_template.json", TOKENIZER_CONFIG)]
    return all((pa / n).is_file() == (pb / n).is_file() and (not (pa / n).is_file() or
                                                           (pa / n).read_bytes() == (pb / n).read_bytes())
               for n in names)
