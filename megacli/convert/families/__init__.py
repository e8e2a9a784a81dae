"""The model families `megacli convert` knows, chosen by the HF config's ``architectures[0]``.

A family is one module here with:

    ARCHITECTURES     the HF architecture names it handles
    ARCH              the recipe ``model.arch`` it produces ("gpt", "bert" or "t5")
    model_section(hf_config: dict) -> dict
                      the recipe ``model:`` section for an HF config (UserError when the config
                      uses a feature the Megatron model cannot express)
    architecture_for(model, preferred=None) -> str | None
                      the HF architecture a recipe model exports to (``preferred`` when it can
                      express the model), None when the family cannot express it
    hf_config(model, *, architecture, vocab_size, base) -> dict
                      the HF config.json for a recipe model (``base``: the source model's config,
                      when the checkpoint carries it, whose other fields are kept)
    table(model) -> MappingTable
                      the weight mapping for that model
    import_notes(hf_config: dict) -> list[str]
                      optional: what an import leaves out, printed by the conversion

Adding a family is one module plus its name in FAMILY_MODULES.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from megacli.errors import UserError

FAMILY_MODULES = ("gpt2", "llama", "gemma", "moe", "olmo2", "phi3", "deepseek", "bert", "t5")


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"megacli.convert.families.{name}")


def families() -> list[ModuleType]:
    return [_load(n) for n in FAMILY_MODULES]


def supported_architectures() -> list[str]:
    return [a for fam in families() for a in fam.ARCHITECTURES]


def for_hf_config(config: dict) -> tuple[ModuleType, str]:
    """(family module, architecture) for an HF config.json."""
    archs = config.get("architectures") or []
    if not archs:
        raise UserError(f"config.json has no 'architectures' entry (model_type {config.get('model_type')!r}); "
                        f"supported: {', '.join(supported_architectures())}")
    arch = archs[0]
    for fam in families():
        if arch in fam.ARCHITECTURES:
            return fam, arch
    raise UserError(f"unsupported architecture {arch!r}; megacli convert supports {', '.join(supported_architectures())}")


def for_model(model, *, preferred: str | None = None) -> tuple[ModuleType, str]:
    """(family module, HF architecture) for a recipe ``model:`` section; ``preferred`` (the
    architecture of a carried HF config) wins when its family can express the model."""
    ranked = sorted(families(), key=lambda fam: preferred not in fam.ARCHITECTURES)
    for fam in ranked:
        arch = fam.architecture_for(model, preferred if preferred in fam.ARCHITECTURES else None)
        if arch is not None:
            return fam, arch
    m = model
    raise UserError(f"no Hugging Face family can express this model (arch {m.arch}, {m.position_embedding} positions, "
                    f"{m.normalization}, {m.activation}, bias {m.add_bias_linear}); supported: "
                    f"{', '.join(supported_architectures())}")


def require(config: dict, *names: str):
    """The first of ``names`` present in an HF config (configs spell some fields two ways)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    raise UserError(f"config.json lacks {' / '.join(names)} (model_type {config.get('model_type')!r})")
