"""The rules of a composed config that span its groups; run by runner/job/compose.py's
``to_config`` right after the schema's own checks (runner/config/schema.py), before any work is
done.

``check_config`` holds the cross-field rules: what one group's value asks of another's
(``models=[...]`` needs ``task=infer``, ``dataset.val_fraction`` needs ``task=train``, a
resume needs training, ...), what a task makes of the loader (``loader.shuffle`` unset:
shuffled for training, dataset order for inference; inference ignores
``loader.drop_last``), an inference setting that would do nothing (``task.outputs=[]``,
``task.embed_layer`` without embeddings), and the task's own keys: a ``task.*`` key that
another task alone reads (``TASK_KEYS`` in runner/config/schema.py) is refused, named with the
task that reads it, as a typo is refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runner.common.errors import ConfigError
from runner.config.credentials import check_config_urls
from runner.config.schema import (
    NO_MODEL,
    TASK_KEYS,
    AutoAugmentName,
    Config,
    Crop,
    ModelConfig,
    ModelSource,
    Output,
    TaskConfig,
    TaskName,
    data_path_alone,
    plain_name,
    to_plain,
)

log = logging.getLogger(__name__)


def model_configs(config: Config) -> list[ModelConfig]:
    """The run's models: ``model=``, or each entry of ``models=[...]`` (a name, or a mapping
    with the keys of ``model.``) over ``model=``'s values, each with a name of its own in
    outputs and figures (``alias``; two entries of one architecture are told apart by
    their weights' file names)."""
    if not config.models:
        return [config.model]
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    models = []
    for entry in config.models:
        fields = {"name": entry} if isinstance(entry, str) else dict(entry)
        if "name" not in fields:
            raise ConfigError(f"models entry {fields} has no name: give each entry a name, "
                              "e.g. {name:resnet18,weights:/models/a.pt}")
        try:
            merged = OmegaConf.merge(OmegaConf.structured(config.model), fields)
            models.append(OmegaConf.to_object(merged))
        except OmegaConfBaseException as e:
            raise ConfigError(f"models entry {fields}: {str(e).splitlines()[0]} (an entry "
                              "takes the keys of model.: name, weights, num_classes, classes, "
                              "mean, std, image_size, alias, ...)") from e
    labels = [m.label for m in models]
    named = [k for k, m in enumerate(models)
             if labels.count(m.label) > 1 and m.alias is None and m.weights]
    for k in named:
        m = models[k]
        models[k] = dataclasses.replace(m, alias=f"{m.name}-{Path(m.weights).stem}")
    labels = [m.label for m in models]
    for k in named:  # weights files of one name in other folders: the folder too
        m = models[k]
        if labels.count(m.label) > 1:
            where = Path(m.weights).expanduser().parent.name
            models[k] = dataclasses.replace(m, alias=f"{m.name}-{where}-{Path(m.weights).stem}")
    labels = [m.label for m in models]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        weights = sorted({str(m.weights) for m in models if m.label in twice and m.weights})
        why = (f" (their weights files {', '.join(weights)} cannot tell them apart)"
               if len(weights) > 1 else
               f" (one weights file {weights[0]})" if weights else "")
        raise ConfigError(f"models=[...] names {', '.join(twice)} more than once{why}: give "
                          "each entry an alias (models=[{name:resnet18,weights:...,alias:a},"
                          "...])")
    return models


def unknown_model(name: str, known: Iterable[str]) -> ConfigError:
    """The refusal of a ``model.name`` that neither the runner nor torchvision has (``known``:
    the names there are), with the closest: one message whether it is found before torch
    (runner/job/precheck.py, from torchvision's sources) or by the model's own check
    (runner/model/networks.py's ``check_model``)."""
    import difflib

    known = sorted(known)
    near = difflib.get_close_matches(name, known, n=3)
    meant = f" (did you mean {', '.join(near)}?)" if near else ""
    return ConfigError(
        f"model.name={name} is not a torchvision classification, segmentation or detection "
        f"model{meant}; choose tiny, none or one of torchvision's builders (e.g. "
        "resnet50, efficientnet_b0, vit_b_16, convnext_tiny, deeplabv3_mobilenet_v3_large, "
        "fasterrcnn_mobilenet_v3_large_320_fpn), or model=timm / model=custom")


def check_config(config: Config, given: Iterable[str] = ()) -> None:
    """Every rule across the groups of ``config``, and what a task makes of the loader;
    ``given``: the overrides it was composed from (a task key named there is refused even
    at its default value). Raises ConfigError naming the keys and the fix."""
    check_config_urls(config)  # no credentials in a URL (runner/config/credentials.py)
    check_infer_outputs(config.task)
    check_task_keys(config.task, given)
    if config.models:
        model_configs(config)  # every entry checked: its keys, values and name
        check_model_beside_models(config, given)
    # one decode feeds every model: at the largest size a model of the pass takes
    sizes = [list(m.image_size) for m in model_configs(config) if m.image_size]
    largest = max([list(config.dataset.image_size), *sizes], key=lambda hw: hw[0] * hw[1])
    if largest != list(config.dataset.image_size):
        config.dataset.image_size = largest
    task, dataset = config.task.name, config.dataset
    if config.models and task is not TaskName.infer:
        raise ConfigError(f"models={list(config.models)} runs several models in one "
                          "inference pass: it needs task=infer")
    if config.loader.shuffle is None:  # infer reads in dataset order unless asked
        config.loader.shuffle = task is TaskName.train
    if task is TaskName.infer and config.loader.drop_last:
        log.warning("loader.drop_last=true is ignored by task=infer: every image gets "
                    "its outputs, the last, partial batch's too")
        config.loader.drop_last = False
    if task is TaskName.infer:
        for m in model_configs(config):  # its name is a file name in the run folder
            if not plain_name(m.label):
                raise ConfigError(f"model.name={m.name!r} is invalid: names the model's files "
                                  "in the run folder, and is not a plain file name: give it "
                                  "a plain model.alias")
    if config.resume not in (None, "auto") and task is not TaskName.train:
        raise ConfigError(f"resume={config.resume} continues training from a checkpoint: it "
                          "needs task=train (to infer with trained weights, use "
                          "model.weights=PATH; resume=auto continues a stopped inference "
                          "run in its folder)")
    if dataset.val_path is not None and dataset.val_fraction > 0:
        raise ConfigError(f"dataset.val_fraction={dataset.val_fraction} and "
                          f"dataset.val_path={dataset.val_path}: give one place to "
                          "validate on")
    if dataset.val_fraction > 0 and task is not TaskName.train:
        raise ConfigError(f"dataset.val_fraction={dataset.val_fraction} holds images "
                          "out of training: it needs task=train")
    if dataset.val_path is not None and (task is not TaskName.train
                                         or data_path_alone(config)):
        raise ConfigError(f"dataset.val_path={dataset.val_path} reports top-1 while "
                          "training: it needs task=train and a model (not model=none)")
    check_targets(config)
    if config.loader.group_aspect and dataset.crop not in (Crop.whole, Crop.letterbox):
        raise ConfigError(f"loader.group_aspect=true with dataset.crop={dataset.crop.value}: "
                          "a crop of one shape from every image makes the aspect of none "
                          "matter; use it with dataset.crop=letterbox or whole")
    if NO_MODEL in [m.name for m in model_configs(config)] and config.models:
        raise ConfigError("models=[...] cannot hold none: leave models unset and use "
                          "model=none to measure the data path alone")


def check_model_beside_models(config: Config, given: Iterable[str] = ()) -> None:
    """A ConfigError for a model named on the command line (``model=resnet18``,
    ``model.name=...``) beside ``models=[...]`` that holds no entry of that name: the
    entries run alone (``model=`` only gives their defaults), so it would silently not run.
    A preset that sets a source (``model=timm``, ``model=custom``) gives the entries their
    source, and is not a model named."""
    named, by = None, "model"
    for override in given:
        key = override.lstrip("+").partition("=")[0]
        if key == "model.name" or (key == "model"
                                   and config.model.source is ModelSource.torchvision):
            named, by = config.model.name, key
    entries = [m.name for m in model_configs(config)]
    if named is None or named in entries:
        return
    raise ConfigError(f"{by}={named} and models=[{','.join(entries)}]: models=[...] runs "
                      f"its entries alone (model= only gives them defaults), so {named} "
                      f"would not run: add it, models=[{','.join([named, *entries])}], or "
                      "drop model=")


def check_infer_outputs(task: TaskConfig) -> None:
    """A ConfigError for an inference setting that would silently do nothing: no output kept
    of any image, or an embedding layer named without embeddings among the outputs."""
    if task.name is TaskName.infer and task.write_outputs and task.outputs == [] \
            and task.postprocess is None:
        raise ConfigError(
            "task.outputs=[] keeps nothing of any image with task=infer: name at least one "
            f"of {', '.join(o.value for o in Output)}, or give task.write_outputs=false "
            "to run the model without writing anything")
    if task.embed_layer is not None and Output.embeddings not in (task.outputs or ()):
        now = "unset: the model's own" if task.outputs is None \
            else f"[{','.join(o.value for o in task.outputs)}]"
        raise ConfigError(
            f"task.embed_layer={task.embed_layer} has no effect without embeddings in "
            f"task.outputs (now {now}): add them, "
            "task.outputs=[topk,embeddings], or leave task.embed_layer unset")


def _defaults(cls: type) -> dict[str, Any]:
    """A config dataclass's fields at their defaults, flat (``augment.mixup``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            if dataclasses.is_dataclass(value):
                out.update({f"{f.name}.{k}": v for k, v in _defaults(type(value)).items()})
            else:
                out[f.name] = value
    return out


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if not dataclasses.is_dataclass(value):
        return {prefix: value}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        out.update(_flat(getattr(value, f.name), f"{prefix}.{f.name}" if prefix else f.name))
    return out


def _shown(value: Any) -> str:
    plain = to_plain(value)
    if isinstance(plain, list):
        return "[" + ",".join(str(v) for v in plain) + "]"
    return str(plain)


def check_task_keys(task: TaskConfig, given: Iterable[str] = ()) -> None:
    """A ConfigError when ``task`` holds a key that another task alone reads: set away from
    its default (by an override, a recipe or a preset), or named in the overrides
    ``given``. The message names the key, the task that reads it and the run's task."""
    named = set()
    for override in given:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("task."):
            named.add(key[len("task."):])
    defaults = _defaults(TaskConfig)
    for key, value in _flat(task).items():
        top = key.split(".")[0]
        owner = next((t for t, keys in TASK_KEYS.items() if top in keys), None)
        if owner is None or owner is task.name:
            continue
        if key in named or top in named or value != defaults.get(key, value):
            own = ", ".join(TASK_KEYS.get(task.name, ()))
            raise ConfigError(
                f"task.{key}={_shown(value)} is a task={owner.value} key: task="
                f"{task.name.value} does not read it (its own keys are {own}); leave it "
                f"out, or use task={owner.value}")


def check_targets(config: Config) -> None:
    """Detection boxes (``dataset.targets``): with no device augmentation that moves pixels
    (randaugment's shears and turns, MixUp, CutMix); which storages and decoders carry
    them, and from where (a local folder, or a store at a URL), ``settle_loader`` asks
    their records (runner/data/storage/__init__.py)."""
    dataset, augment = config.dataset, config.task.augment
    if not dataset.targets.boxes:
        for name in ("mosaic", "box_crop"):
            if getattr(augment, name):
                raise ConfigError(f"task.augment.{name}={getattr(augment, name):g} moves "
                                  "detection boxes with the pixels: it needs "
                                  "dataset.targets=auto, yolo or coco")
        return
    given = f"dataset.targets={dataset.targets.value}"
    if dataset.crop is Crop.center:  # only when asked: the default is the letterbox
        log.warning("dataset.crop=center with %s: the centre crop cuts away boxes near the "
                    "sides (dataset.crop=letterbox, the detectors' default, keeps them)",
                    given)
    if augment.auto is not AutoAugmentName.none:  # (MixUp, CutMix: the detector refuses)
        raise ConfigError(f"task.augment.auto={augment.auto.value} turns, shears and shifts "
                          f"pixels, and {given}'s boxes would not follow: leave "
                          "task.augment.auto=none for detection")
