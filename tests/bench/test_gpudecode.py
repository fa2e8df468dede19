"""``python -m runner.bench gpudecode``: its paths compose, its three targets come from the
measured medians, and without CUDA it says so in one line (its figures need a GPU)."""

from __future__ import annotations

import pytest
import torch

from runner.bench import gpudecode


def test_every_path_is_a_config_the_runner_takes():
    from runner.job.compose import compose

    configs = gpudecode.configurations(16, 128, "cpu")
    assert set(configs) == set(gpudecode.ROLES)
    seen = {}
    for role, (name, overrides) in configs.items():
        cfg = compose(overrides)
        seen[role] = (cfg.loader.name.value, cfg.loader.decoder.value, cfg.loader.num_workers)
        assert name == f"{seen[role][0]} {seen[role][1]}, {seen[role][2]} workers"
    gpu, cpu = gpudecode.gpu_decoder(), gpudecode.best_cpu_decoder()
    assert seen["folder_gpu"][1:] == (gpu, 16) and seen["folder_cpu_2"][1:] == (cpu, 2)
    assert seen["packed_gpu"][0] == seen["packed_cpu"][0] != seen["folder_gpu"][0]


def test_the_three_targets_are_ratios_of_the_medians():
    def at(median):
        return {"median": median}

    names = {role: name for role, (name, _) in gpudecode.configurations(16, 128, "cpu").items()}
    result = {role: {**at(m), "name": names[role]} for role, m in zip(
        gpudecode.ROLES, (9_000.0, 5_000.0, 4_000.0, 4_500.0, 1_000.0))}
    checks = gpudecode.targets(result, 16, "NVIDIA H200")
    assert [round(c["figure"], 2) for c in checks] == [9_000.0, 1.25, 4.5]
    assert [c["met"] for c in checks] == [True, True, False]  # 4.5x < 5x at 2 workers
    result["folder_gpu"]["median"] = 7_999.0
    assert gpudecode.targets(result, 16, "NVIDIA H200")[0]["met"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_without_cuda_it_says_so_and_stops(capsys, tmp_path):
    from runner.bench.cli import main

    with pytest.raises(SystemExit, match="decodes on a CUDA GPU and this machine has none"):
        main(["gpudecode", "--out", str(tmp_path)])
