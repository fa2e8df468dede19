"""Every preset of every group composes, validates and builds; bad input fails clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from runner.common.errors import ConfigError, Unavailable
from runner.config.schema import Decoder, ModelConfig
from runner.data.decode.decoders import DECODERS
from runner.job.commandline import register_configs, unknown_key_message
from runner.job.compose import compose, to_config
from runner.model.networks import build_model
from tests.conftest import REPO, compose_config, make_loader, run_cli

CONF = REPO / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")  # hydra/: launchers
PRESETS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

register_configs()


def test_every_group_has_presets_and_a_builder():
    assert {"loader", "model", "task", "logger"} <= set(GROUPS)
    assert all(any(g == group for g, _ in PRESETS) for group in GROUPS)
    # a new group gets built below too; sweeps and recipes are whole-config presets
    # (tests/job/test_sweep.py, tests/tasks/train/test_training.py)
    assert set(GROUPS) - {"sweep", "recipe"} == set(BUILDERS)


def build_loader_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from runner.data.loading.loader import BatchStream
    from runner.data.storage import build_storage

    storage = build_storage(config.loader, config.dataset, image_tree, progress=False)
    assert len(storage) == 18
    loader = make_loader(storage, config.loader, config.seed, pin_memory=False)
    batch = next(iter(BatchStream(loader, epochs=1)))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape[1:] == (3, 224, 224)


def build_prefetch_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from runner.data.device.prefetch import build_prefetcher

    source = [{"x": torch.arange(3)}, {"x": torch.arange(3) + 3}]
    prefetcher = build_prefetcher(config.prefetch, source, DEVICE)
    assert [b["x"].tolist() for b in prefetcher] == [[0, 1, 2], [3, 4, 5]]


def build_amp_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from runner.model.amp import DTYPES, autocast, check_amp

    check_amp(config.amp, DEVICE)
    with autocast(config.amp, DEVICE):
        y = torch.ones(2, 2, device=DEVICE) @ torch.ones(2, 2, device=DEVICE)
    assert y.dtype == (DTYPES[config.amp.name] or torch.float32)


def build_compile_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from runner.config.schema import TaskName
    from runner.model.compile import compile_model
    from runner.model.networks import build_model

    model = build_model(ModelConfig("tiny"), 3, DEVICE).eval()
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, device=DEVICE)
    compiled, _ = compile_model(model, config.compile, config.amp, TaskName.infer, x, [2],
                                tmp_path)
    with torch.inference_mode():
        assert compiled(x).shape == (2, 3)


def build_model_preset(config, tmp_path: Path, image_tree: Path) -> None:

    model = build_model(config.model, num_classes=3, device=CPU)
    if config.model.name == "none":
        assert model is None
    else:
        assert model(torch.zeros(2, 3, 32, 32, dtype=torch.uint8)).shape == (2, 3)


def build_task_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from tensordict import TensorDict

    from runner.model.networks import build_model
    from runner.tasks import make_step

    model = build_model(ModelConfig("tiny"), 3, CPU)
    step = make_step(config.task, {"tiny": model}, config.amp, CPU, total_steps=2)
    batch = TensorDict({"image": torch.zeros(4, 3, 32, 32, dtype=torch.uint8),
                        "label": torch.zeros(4, dtype=torch.int64),
                        "index": torch.arange(4)}, batch_size=[4])
    step(batch)
    step(batch)
    assert isinstance(step.close(), dict)


def build_logger_preset(config, tmp_path: Path, image_tree: Path) -> None:
    from runner.job.logger import build_logger

    logger = build_logger(config.logger, tmp_path, {"loader.name": "folder"}, "test", None)
    logger.log({"images_per_sec": 1.0}, step=1)
    logger.summary({"status": "ok"})
    logger.close("ok")


BUILDERS = {"loader": build_loader_preset, "prefetch": build_prefetch_preset,
            "amp": build_amp_preset, "compile": build_compile_preset,
            "model": build_model_preset, "task": build_task_preset,
            "logger": build_logger_preset}


# building these starts a process (inductor's C++ compiler, wandb's service) or takes seconds
MARKS = {("compile", "inductor"): pytest.mark.process, ("logger", "wandb"): pytest.mark.process,
         ("compile", "onnxruntime"): pytest.mark.slow, ("model", "timm"): pytest.mark.slow,
         ("model", "resnet50"): pytest.mark.slow}


@pytest.mark.parametrize(("group", "preset"), [
    pytest.param(*p, marks=MARKS[p]) if p in MARKS else p
    for p in PRESETS if p[0] not in ("sweep", "recipe")])
def test_preset_composes_and_builds(group: str, preset: str, image_tree: Path, tmp_path: Path):
    """Every preset builds its real object here, or (on a machine that cannot run it) is
    refused with a reason naming what is missing, the way a run records a skip."""
    extra = {("model", "custom"): ["model.target=tests.nets:TwoLayer"],
             ("loader", "user"): ["dataset.target=tests.user_data:eighteen"]
             }.get((group, preset), [])
    config = to_config(compose_config(f"{group}={preset}", *extra))
    name = getattr(config, group).name
    source = getattr(getattr(config, group), "source", None)
    # the preset selects what it is named (model=timm/custom: the source)
    assert preset in (getattr(name, "value", name), getattr(source, "value", None))
    try:
        BUILDERS[group](config, tmp_path, image_tree)
    except Unavailable as e:
        assert str(e), "a skip must say why"
        pytest.skip(f"{group}={preset}: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for g, p in PRESETS if g == "sweep"])
def test_sweep_presets_compose_into_valid_jobs(preset: str):
    """Each named matrix composes, and every job it would launch is a valid config."""
    import itertools

    cfg = compose_config(f"sweep={preset}", hydra=True)
    if preset == "autotune":  # no matrix: the trials optuna would ask for, sampled
        optuna = pytest.importorskip("optuna")
        from runner.job.sweep import autotune_space

        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        for _ in range(25):
            trial = study.ask()
            autotune_space(cfg, trial)
            to_config(compose_config(f"sweep={preset}",
                                     *(f"{k}={v}" for k, v in trial.params.items())))
            study.tell(trial, 1.0)
        return
    params = {k: str(v) for k, v in cfg.hydra.sweeper.params.items()}
    assert params, f"sweep={preset} sweeps nothing"
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices = [[f"{k}={v}" for v in parser.parse_override(f"{k}={v}").sweep_string_iterator()]
               for k, v in params.items()]
    for job in itertools.product(*choices):
        to_config(compose_config(f"sweep={preset}", *job))


def test_defaults_are_the_small_cpu_job():
    config = to_config(compose_config())
    assert (config.loader.name.name, config.model.name, config.task.name.name) == (
        "folder", "tiny", "train")
    # folder decodes with one thread per core in process, simplejpeg: the measured fastest
    # loader.decoder=auto: the region decoder where its binding is built (here, and in CI)
    fastest = "region" if DECODERS[Decoder.region].available() else "simplejpeg"
    assert config.loader.num_workers == 0 and config.loader.decoder.value == fastest
    assert config.logger.name.name == "wandb" and config.logger.mode is None  # offline at init
    assert config.dataset.path is None and config.dataset.num_images == 2000


@pytest.mark.parametrize(("override", "draft"), [((), True), (("loader.draft=false",), False),
                                               (("loader.draft=true",), True)])
def test_auto_falling_back_to_simplejpeg_pairs_it_with_draft_unless_told(no_region_binding,
                                                                        override, draft):
    """Without the region binding, loader.decoder=auto is simplejpeg with draft; a draft
    the user sets is kept (an explicit false is not turned on)."""
    config = to_config(compose_config(*override))
    assert (config.loader.decoder, config.loader.draft) == (Decoder.simplejpeg, draft)


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["pil", "region"])
def test_draft_left_unset_is_off_for_a_decoder_the_user_names(decoder):
    if not DECODERS[Decoder(decoder)].available():
        pytest.skip(f"loader.decoder={decoder} is not built here")
    config = to_config(compose_config(f"loader.decoder={decoder}"))
    assert config.loader.draft is False
    assert to_config(compose_config("loader=memmap")).loader.draft is False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("loader.batch_size=0", "loader.batch_size=0 is invalid: must be >= 1"),
        ("loader.num_workers=-1", "loader.num_workers=-1 is invalid: must be >= 0"),
        ("loader.prefetch_factor=0", "loader.prefetch_factor=0 is invalid"),
        ("dataset.image_size=[224]", "dataset.image_size=[224] is invalid: give [height, width]"),
        ("dataset.quality=0", "dataset.quality=0 is invalid: must be in 1..100"),
        ("run.steps=0", "run.steps=0 is invalid"),
        ("task.topk=0", "task.topk=0 is invalid"),
    ],
)
def test_bad_values_name_the_key(override: str, expected: str):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        to_config(compose_config(override))


def test_unknown_decoder_lists_the_choices():
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose_config("loader.decoder=libjpeg")
    message = str(info.value) + str(info.value.__cause__)
    assert "loader.decoder" in message
    assert "expected one of [pil, simplejpeg, jpeg4py, torchvision, nvjpeg, region, auto]" in message


def test_unknown_key_suggests_the_valid_one():
    message = unknown_key_message("loader.batchsize=3")
    assert "loader.batchsize" in message and "batch_size, num_workers" in message
    assert message.endswith("Did you mean loader.batch_size?")
    assert unknown_key_message("loader.batch_size=3") is None
    assert unknown_key_message("loader=folder") is None
    # an append names a key of the schema too (only the open mappings take new ones)
    assert unknown_key_message("+extra=1").startswith("unknown config key 'extra'")
    assert unknown_key_message("+model.kwargs.width=64") is None



@pytest.mark.process
def test_a_renamed_key_points_to_its_new_name(tmp_path: Path):
    # task.write_predictions gated every output kind, not only predictions: now write_outputs
    message = unknown_key_message("task.write_predictions=false")
    assert message.startswith("unknown config key 'task.write_predictions'")
    assert message.endswith("Did you mean task.write_outputs? (renamed from "
                            "task.write_predictions)")
    assert unknown_key_message("task.write_outputs=false") is None
    proc = run_cli("task=infer", "task.write_predictions=false", cwd=tmp_path, check=False,
                   timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "Did you mean task.write_outputs?" in proc.stderr
    assert not any(tmp_path.iterdir())  # refused before Hydra made a run folder

@pytest.mark.process
@pytest.mark.slow
def test_cli_rejects_typos_and_bad_values_before_any_work(tmp_path: Path, cache_dir: Path):
    proc = run_cli("loader.batchsize=3", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "Did you mean loader.batch_size?" in proc.stderr
    proc = run_cli("loader.batch_size=0", "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "loader.batch_size=0 is invalid: must be >= 1" in proc.stdout + proc.stderr
    proc = run_cli("loader=memmapp", cwd=tmp_path, check=False)  # a group choice: one line
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "the choices are dali, ffcv, folder, memmap" in proc.stderr
    assert "Did you mean loader=memmap?" in proc.stderr
    proc = run_cli("-m", "loader=folder,nope", cwd=tmp_path, check=False)  # each value of a sweep
    assert proc.returncode == 2 and "there is no loader preset 'nope'" in proc.stderr
    assert not cache_dir.exists()  # failed before the default dataset was made


@pytest.mark.process
@pytest.mark.slow
def test_a_misspelt_model_in_models_is_refused_before_any_dataset_is_made(tmp_path: Path,
                                                                       cache_dir: Path):
    proc = run_cli("task=infer", "models=[resnet18,resnett50]", "logger=none",
                   "loader=memmap", "hydra.run.dir=run", cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2
    assert "model.name=resnett50 is not a torchvision classification, segmentation or detection" \
        " model" in out
    assert "did you mean resnet50" in out
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.jpg"))  # nothing generated


def test_every_model_name_is_checked_when_the_config_is_composed():
    from runner.job.compose import compose

    with pytest.raises(ConfigError, match="resnett50"):
        compose(["task=infer", "models=[resnet18,resnett50]"])
    with pytest.raises(ConfigError, match="model.name=resnett18"):
        compose(["model.name=resnett18"])


@pytest.mark.slow
def test_a_loader_with_no_batches_is_a_users_mistake_not_a_bug(tmp_path: Path, image_tree: Path):
    from runner.data import build_data_path
    from runner.job.compose import compose

    config = compose([f"dataset.path={image_tree}", "loader.batch_size=64",
                      "loader.drop_last=true", "dataset.image_size=[16,16]"])
    with pytest.raises(ConfigError, match="loader.drop_last=false"):
        build_data_path(config, torch.device("cpu"), progress=False)


def test_help_gives_every_preset_one_whole_line():
    """--help used to cut the packed, dali and ffcv lines at the first colon of their
    comments, in the middle of a parenthesis."""
    from runner.job.commandline import help_text

    presets = [line for line in help_text().split("== Flags")[0].splitlines()
               if line.startswith("  ")]
    assert len(presets) >= 25
    for line in presets:
        assert len(line) <= 100 and line.count("(") == line.count(")"), line
        assert not line.rstrip().endswith((":", ","))


def header_words(path: Path) -> list[str]:
    """The words of a preset's opening comment (not ``@package`` nor the example commands)."""
    import re

    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith(("# @package", "#   ")):
            lines.append(line[1:])
    return [w.strip(".,:;()") for w in re.findall(r"\S+", " ".join(lines).lower())]


@pytest.mark.parametrize("path", sorted(CONF.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONF)))
def test_a_presets_header_says_each_thing_once(path: Path):
    """A header whose second sentence says the first again (the same four words in a row
    twice) reads as two drafts left one above the other."""
    words = header_words(path)
    first: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - 3):
        four = tuple(words[i:i + 4])
        assert first.setdefault(four, i) >= i - 3, f"{path.name}: '{' '.join(four)}' twice"


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["../evil", "sub/name", "..", ".hidden", "a\\b", ""])
def test_an_alias_that_is_not_a_plain_name_is_refused_at_the_config_check(alias: str):
    for over in ([f"model.alias='{alias}'"], [f"+models=[{{name:tiny,alias:'{alias}'}}]"]):
        with pytest.raises(ConfigError, match="alias") as refused:
            compose(["task=infer", *over])
        assert "\n" not in str(refused.value)
