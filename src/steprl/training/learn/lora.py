"""LoRA (`model.lora`, the `lora` extra): the learner trains adapters, the engine merges them.

* `apply_lora` wraps the policy in a peft model: base weights frozen, adapters trainable (the
  learner's optimizer holds only parameters that require grad).
* `adapter_update` is what a weight update sends: the A/B matrices and scaling of each targeted
  Linear (`engines.lora_merge.AdapterUpdate`), never the base. The engine keeps a plain
  copy of the base and writes W0 + scaling * B @ A into it: generating through unmerged peft
  layers was measured 16x slower.
* `AdaptersDisabled` is the KL reference: the same model with its adapters switched off (the
  base), not a second copy of the weights.
* `save_adapters` writes a checkpoint of the adapters that names its base
  (`adapter_config.json: base_model_name_or_path`); a base that exists nowhere on disk (a
  scratch or freshly warm-started tiny model) is saved next to the adapters, under `base/`.

Adapter dtype: fp32, also over a bf16 base (peft's `autocast_adapter_dtype`). The adapters are a
small fraction of the model, so fp32 costs little memory, and their AdamW updates are far below
bf16's resolution (8 mantissa bits) relative to the weights: bf16 adapters would drop most steps.
The engine merges in fp32 and rounds once into its copy's dtype.

peft is imported only when LoRA is asked for: the core install never needs it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from steprl.engines.lora_merge import AdapterUpdate, LoraDelta
from steprl.errors import UserError
from steprl.extras import require

ADAPTER = "default"  # peft's name for the one adapter we train
#: in a learner rank's settings, LoRA's KL reference: the rank's own policy with its adapters off
ADAPTERS_OFF = "adapters_disabled"


class LoraConfigError(UserError):
    """`model.lora` does not fit the model (e.g. a target module it does not have)."""


class LoraSpec(Protocol):
    """What `apply_lora` reads: `config.LoraSection` or anything shaped like it."""

    @property
    def r(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def dropout(self) -> float: ...
    @property
    def target_modules(self) -> Sequence[str]: ...


def is_peft(model: object) -> bool:
    """True for a peft-wrapped model. No import: if peft is not loaded, nothing is wrapped."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _adaptable_linears(model: nn.Module) -> list[str]:
    """Paths of the model's Linear modules, the output head excluded (see `check_targets`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct short names of the Linear modules that can carry an adapter."""
    return sorted({name.rsplit(".", 1)[-1] for name in _adaptable_linears(model)})


def check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Every target must name (as peft matches: the full path or its last dotted parts) at least
    one Linear of the model other than the output head; one line listing what exists otherwise.

    The output head is refused because it is often tied to the input embeddings (the tiny model,
    Gemma): merging into it would change the embeddings too.
    """
    linears = _adaptable_linears(model)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linears)]
    if missing or not targets:
        names = ", ".join(linear_module_names(model))
        what = f"names {', '.join(missing)}, which" if missing else "is empty;"
        raise LoraConfigError(
            f"model.lora.target_modules {what} {type(model).__name__} does not have as Linear modules "
            f"(the output head is not a target); its Linear modules: {names} "
            "(e.g. --set 'model.lora.target_modules=[q_proj, v_proj]')"
        )


def base_dir(model: nn.Module) -> str | None:
    """Where the base's weights live on disk: the directory it was loaded from, if it still holds a
    Hugging Face model; None for a model built in memory (scratch, fresh warm start)."""
    name = str(getattr(model, "name_or_path", "") or "")
    return str(Path(name).resolve()) if name and (Path(name) / "config.json").is_file() else None


def apply_lora(model: nn.Module, spec: LoraSpec, log: Callable[[str], None] | None = None) -> Any:
    """Wrap `model` (in place: peft injects its layers into it) with trainable LoRA adapters on
    `spec.target_modules`; every base weight is frozen. Returns the peft model."""
    peft = require("peft", extra="lora", feature="model.lora")
    targets = list(spec.target_modules)
    check_targets(model, targets)
    config = peft.LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    name = base_dir(model)
    with warnings.catch_warnings():  # transformers' deprecation notes from inside peft: not ours to fix
        warnings.simplefilter("ignore", FutureWarning)
        wrapped = peft.get_peft_model(model, config)  # autocast_adapter_dtype: fp32 adapters
    wrapped.peft_config[ADAPTER].base_model_name_or_path = name
    if log is not None:
        trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
        total = sum(p.numel() for p in wrapped.parameters())
        log(
            f"LoRA r={spec.r} alpha={spec.alpha:g} on {', '.join(targets)}: {trainable:,} trainable of "
            f"{total:,} parameters; base {name or '(in memory: checkpoints save a copy)'}"
        )
    return wrapped


def _lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """(path in the plain base model, peft LoRA layer) for every adapted module."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def adapter_update(model: Any) -> AdapterUpdate:
    """The adapters of a peft model as the record the engines merge (copies: later optimizer steps
    must not change what was sent)."""
    deltas = []
    for name, layer in _lora_layers(model):
        if ADAPTER in getattr(layer, "lora_variant", {}) or getattr(layer, "fan_in_fan_out", False):
            raise LoraConfigError(f"{name}: only plain LoRA on nn.Linear merges in the engine (no DoRA)")
        deltas.append(
            LoraDelta(
                name,
                layer.lora_A[ADAPTER].weight.detach().clone(),
                layer.lora_B[ADAPTER].weight.detach().clone(),
                float(layer.scaling[ADAPTER]),
            )
        )
    return AdapterUpdate(tuple(deltas))


class AdaptersDisabled(nn.Module):
    """The base of a peft model as a model: `forward` runs the peft model with its adapters
    disabled (peft's `disable_adapter()`) and in eval mode, so a KL reference costs no second
    copy of the weights.

    The peft model is deliberately *not* a registered submodule: `.to()`, `.eval()` and
    `.parameters()` on the reference must not reach the policy the learner is training.
    """

    peft_model: Any  # a peft.PeftModel (set without registering it as a submodule)

    def __init__(self, peft_model: Any) -> None:
        super().__init__()
        object.__setattr__(self, "peft_model", peft_model)

    @property
    def config(self) -> Any:
        return self.peft_model.config

    def get_output_embeddings(self) -> nn.Module:
        head = self.peft_model.get_output_embeddings()
        return getattr(head, "base_layer", head)  # an adapted head: its base layer (W0)

    def get_input_embeddings(self) -> nn.Module:
        emb = self.peft_model.get_input_embeddings()
        return getattr(emb, "base_layer", emb)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.peft_model.disable_adapter(), eval_mode(self.peft_model):
            return self.peft_model(*args, **kwargs)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode inside (no dropout), each submodule's own training flag restored after (a peft
    model may mix modes: one top-level `train(flag)` would not give them back)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def plain_base(model: Any) -> Any:
    """A plain `transformers` copy of a peft model's base weights (adapters dropped, not merged)."""
    return copy.deepcopy(model).unload()


def save_adapters(model: Any, directory: Path, final: Path) -> None:
    """Write the adapters of a peft model into `directory` (a temp dir renamed to `final` after):
    `adapter_model.safetensors` + `adapter_config.json`, whose `base_model_name_or_path` is the
    base's directory. A base that was never on disk is saved under `base/` and named as
    `final/base`, so the checkpoint loads alone."""
    config = model.peft_config[ADAPTER]
    name = config.base_model_name_or_path
    if name is None or not (Path(name) / "config.json").is_file():
        plain_base(model).save_pretrained(directory / "base")
        name = str((final / "base").resolve())
    declared, config.base_model_name_or_path = config.base_model_name_or_path, name
    try:  # the embeddings are never adapted: no need for peft to probe the base for them
        model.save_pretrained(directory, save_embedding_layers=False)
    finally:
        config.base_model_name_or_path = declared  # the next checkpoint decides afresh


def is_adapter_checkpoint(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_adapter_checkpoint(path: Path, *, merged: bool, dtype: torch.dtype = torch.float32) -> Any:
    """A LoRA checkpoint back as a model: its named base plus the adapters, merged into a plain
    model (`merged=True`: for generation) or as a peft model (to train on)."""
    from transformers import AutoModelForCausalLM

    peft = require("peft", extra="lora", feature="loading a LoRA checkpoint")
    name = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    if not name or not (Path(name) / "config.json").is_file():
        raise LoraConfigError(
            f"{path}: adapter_config.json names the base {name!r}, which is not a saved model directory; "
            "point base_model_name_or_path at the base model the adapters were trained on"
        )
    base = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    with warnings.catch_warnings():  # transformers' deprecation notes from inside peft
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.PeftModel.from_pretrained(base, str(path), is_trainable=not merged)
    return model.merge_and_unload() if merged else model


__all__ = [
    "ADAPTERS_OFF",
    "AdaptersDisabled",
    "LoraConfigError",
    "adapter_update",
    "apply_lora",
    "check_targets",
    "is_adapter_checkpoint",
    "is_peft",
    "linear_module_names",
    "load_adapter_checkpoint",
    "plain_base",
    "save_adapters",
]
