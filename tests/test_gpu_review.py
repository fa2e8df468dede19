"""What the third GPU review found in the loop's plumbing (issue 42, item 4 and 7), each
shown on the CPU where it can be, and on CUDA where only a GPU can show it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from runner.config.schema import AmpConfig, AmpName, ModelConfig, Output, TaskConfig, TaskName
from runner.model.networks import build_model

CPU = torch.device("cpu")


def test_a_tensorrt_engine_giving_a_dict_is_read_back_in_float32():
    """compile=tensorrt on a segmentation network: the engine's output is a dict."""
    from runner.model.compile import _HeadThenEngine

    class DictEngine(nn.Module):
        def forward(self, x):
            return {"out": x.half() * 2, "aux": x.half()}

    wrapped = _HeadThenEngine(nn.Identity(), DictEngine(), torch.float16)
    out = wrapped(torch.ones(2, 3, 4, 4))
    assert set(out) == {"out", "aux"}
    assert out["out"].dtype == torch.float32 and torch.equal(out["out"], torch.full_like(
        out["out"], 2.0))


@pytest.mark.parametrize("task", [
    {"outputs": [Output.topk, Output.embeddings]},
    {"outputs": [Output.embeddings], "embed_layer": "features.2"},
], ids=["topk-embeddings", "embeddings-of-a-layer"])
def test_the_verdicts_infer_step_takes_a_task_with_embeddings(task):
    """The verdict builds its InferStep without reducers: a task keeping embeddings (of
    a named layer too, or nothing else) must still give a step that runs (it used to fail
    building a Tap of no network)."""
    from runner.tasks import make_step

    model = build_model(ModelConfig("tiny"), 4, CPU)
    task = TaskConfig(TaskName.infer, **task)
    step = make_step(task, {"tiny": model}, AmpConfig(AmpName.off), CPU, total_steps=2)
    batch = TensorDict({"image": torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8),
                        "label": torch.zeros(3, dtype=torch.long),
                        "index": torch.arange(3)}, batch_size=[3])
    step(batch)
    figures = step.close()
    assert figures["models"]["tiny"]["images_per_sec"] is not None


def test_writer_threads_bind_to_the_runs_gpu(monkeypatch):
    """Each writer thread makes the run's GPU its current device before any CUDA call (an
    index-less ``cuda`` resolved on the main thread), so under torchrun no writer opens a
    context on GPU 0."""
    from runner.tasks.infer.outputs import Outputs

    bound = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda index: bound.append((index, threading.current_thread().name)))
    outputs = Outputs({}, threads=2, device=torch.device("cuda"))
    try:
        outputs.pool.submit(lambda: None).result()
    finally:
        outputs.pool.shutdown(wait=True)
    assert bound and all(index == 3 and name.startswith("outputs") for index, name in bound)

    bound.clear()
    outputs = Outputs({}, threads=1, device=torch.device("cuda", 1))
    outputs.pool.submit(lambda: None).result()
    outputs.pool.shutdown(wait=True)
    assert [index for index, _ in bound] == [1]

    bound.clear()
    cpu = Outputs({}, threads=1, device=CPU)
    cpu.pool.submit(lambda: None).result()
    cpu.pool.shutdown(wait=True)
    assert bound == []  # a CPU run touches no CUDA API


@pytest.mark.cuda
def test_the_prefetch_copy_time_leaves_the_host_gather_out():
    """A source that takes 30 ms of host time per batch: the side-stream copy time per
    step is the copy's (well under a millisecond for a small batch), not the gather's."""
    from runner.data.device.prefetch import CudaStreamPrefetcher

    def slow():
        for _ in range(8):
            time.sleep(0.03)
            yield TensorDict({"image": torch.zeros(4, 3, 32, 32, dtype=torch.uint8)
                              .pin_memory()}, batch_size=[4])

    prefetcher = CudaStreamPrefetcher(slow(), torch.device("cuda"), depth=2)
    assert len(list(prefetcher)) == 8
    assert prefetcher.figures(8)["prefetch_copy_ms"] < 5.0
