"""The loop's accounting (warm-up excluded, data wait attributed) and the prediction writer."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from runner.tasks import DataOnlyStep
from runner.tasks.infer.outputs import ModelWriter, Outputs
from runner.tasks.loop import LoopOptions, OnDevice, run_loop


def batches(n: int, size: int = 4, delay: float = 0.0):
    for i in range(n):
        if delay:
            time.sleep(delay)
        yield TensorDict({"image": torch.zeros(size, 3, 8, 8, dtype=torch.uint8),
                          "label": torch.full((size,), i)}, batch_size=[size])


class SlowStep(DataOnlyStep):
    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self, batch) -> None:
        time.sleep(self.delay)


class RecordingLogger:
    def __init__(self):
        self.calls: list[tuple[int, dict]] = []

    def log(self, figures, step):
        self.calls.append((step, figures))

    def summary(self, figures):
        pass

    def close(self, status):
        pass


def loop(source, step, total=10, warmup=3, log_every=2, logger=None):
    return run_loop(OnDevice(source, torch.device("cpu")), step, logger or RecordingLogger(),
                    LoopOptions(total_steps=total, warmup_steps=warmup, log_every=log_every))


def test_warmup_is_excluded_and_windows_add_up():
    logger = RecordingLogger()
    result = loop(batches(10), DataOnlyStep(), logger=logger)
    assert (result.steps, result.images, result.warmup_steps) == (10, 40, 3)
    assert (result.timed.steps, result.timed.images) == (7, 28)
    # 7 timed steps in 3 repeats end at timed steps 2, 5 and 7; logs every 2nd timed step
    assert [w.steps for w in result.repeats] == [2, 3, 2]
    assert sum(w.seconds for w in result.repeats) == pytest.approx(result.timed.seconds)
    timed_logs = [step for step, figures in logger.calls if "window/images_per_sec" in figures]
    assert timed_logs == [5, 7, 8, 9, 10]
    assert all(k.startswith("window/") for _, figures in logger.calls for k in figures)


def test_waiting_for_data_is_attributed_to_data_wait():
    slow_data = loop(batches(8, delay=0.02), DataOnlyStep(), total=8, warmup=2)
    slow_model = loop(batches(8), SlowStep(0.02), total=8, warmup=2)
    assert slow_data.timed.figures()["data_wait_frac"] > 0.8
    assert slow_model.timed.figures()["data_wait_frac"] < 0.2
    assert slow_model.timed.figures()["compute_frac"] > 0.8


def test_a_short_stream_ends_the_loop():
    result = loop(batches(4), DataOnlyStep(), total=10, warmup=1)
    assert result.steps == 4 and result.timed.steps == 3


def topk_writer(run_dir: Path, names, threads: int = 2, classes=()) -> Outputs:
    """The top-k CSV writer of one model, as task=infer makes it."""
    shapes = {"topk_probs": ((2,), np.dtype("float32")),
              "topk_classes": ((2,), np.dtype("int64"))}
    writer = ModelWriter(run_dir, "m", 9, shapes, names, str, list(classes), list(classes),
                         "predictions.csv", create=True)
    return Outputs({"m": writer}, threads)


def test_predictions_are_written_in_batch_order(tmp_path: Path):
    outputs = topk_writer(tmp_path, lambda i: f"file{i}.jpg", threads=3, classes=["cat", "dog"])
    for step, start in enumerate((0, 3, 6)):
        index = torch.arange(start, start + 3)
        kept = {"topk_probs": torch.tensor([[0.7, 0.2]] * 3),
                "topk_classes": torch.tensor([[1, 0]] * 3)}
        outputs.submit(step, "m", index, index % 2, kept, None)
    assert outputs.close(complete=True, steps=3)["predictions"] == 9
    with open(tmp_path / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["index"]) for r in rows] == list(range(9))
    assert rows[4] == {"index": "4", "file": "file4.jpg", "label": "0", "label_name": "cat",
                       "pred": "1", "pred_name": "dog", "prob": "0.700000",
                       "topk_classes": "1 0", "topk_names": "dog cat",
                       "topk_probs": "0.700000 0.200000"}


def test_a_failing_write_is_raised_not_lost(tmp_path: Path):
    def bad_name(i: int) -> str:
        raise OSError("disk full")

    outputs = topk_writer(tmp_path, bad_name)
    outputs.submit(0, "m", torch.arange(2), torch.zeros(2, dtype=torch.long),
                   {"topk_probs": torch.ones(2, 2), "topk_classes": torch.zeros(2, 2,
                                                                                dtype=torch.long)},
                   None)
    with pytest.raises(RuntimeError, match="writing outputs failed: disk full"):
        outputs.close(complete=True, steps=1)


def endless(size: int = 4):
    while True:
        yield TensorDict({"image": torch.zeros(size, 3, 8, 8, dtype=torch.uint8),
                          "label": torch.zeros(size, dtype=torch.long)}, batch_size=[size])


def test_a_fast_pipelines_windows_are_lengthened_to_last_their_seconds():
    asked = []
    result = run_loop(OnDevice(endless(), torch.device("cpu")), SlowStep(0.001),
                      RecordingLogger(), LoopOptions(total_steps=20, warmup_steps=2, log_every=5,
                                                     repeats=3, min_window_seconds=0.1,
                                                     extend=asked.append))
    assert asked and result.steps == asked[-1] > 20  # the run went on, and said how far
    assert len(result.repeats) == 3
    assert all(w.seconds >= 0.08 for w in result.repeats)  # each window near 0.1 s or more


def test_without_extend_the_run_keeps_its_length_and_its_flags_say_why():
    from runner.tasks.results import loop_figures

    result = run_loop(OnDevice(endless(), torch.device("cpu")), DataOnlyStep(),
                      RecordingLogger(), LoopOptions(total_steps=20, warmup_steps=2, log_every=5,
                                                     repeats=3, min_window_seconds=1.0))
    assert result.steps == 20
    flags = loop_figures(result, [], 3, window_seconds=1.0)["flags"]
    assert any(f.startswith("short windows") for f in flags)


class HostEvents:
    """A CUDA event clock stand-in: timestamps are host seconds, always complete."""

    cuda = True

    def now(self) -> float:
        return time.perf_counter()

    def done(self, stamp) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start


def test_every_gap_before_a_step_is_device_idle_time_the_first_of_a_window_too():
    """The gap before a window's first step and the one after a pause are idle time: with
    stand-in events, gpu_idle is the sum of every data wait (within timer slack)."""
    from runner.measure.clock import StepClock

    clock = StepClock(torch.device("cpu"))
    clock.clock, clock.cuda = HostEvents(), True  # as on CUDA: idle gaps from events
    clock.open_window()
    for k in range(4):
        time.sleep(0.03)  # waiting for data: the device has nothing to do
        first = clock.now()
        time.sleep(0.01)  # the step's device work
        clock.step_done(1, first, clock.now())
        if k == 1:
            with clock.paused():
                time.sleep(0.1)
    window = clock.close_window()
    assert 0.11 <= window.stages["gpu_idle"] < 0.17  # 4 x 30 ms, the pause left out


def test_work_paused_out_of_the_timing_is_no_device_idle_time_either():
    from runner.measure.clock import StepClock

    clock = StepClock(torch.device("cpu"))
    clock.clock, clock.cuda = HostEvents(), True  # as on CUDA: idle gaps from events
    clock.open_window()
    for k in range(4):
        first = clock.now()
        time.sleep(0.01)  # the step's device work
        clock.step_done(1, first, clock.now())
        if k == 1:
            with clock.paused():  # validation, a checkpoint, a cache eviction
                time.sleep(0.2)
    window = clock.close_window()
    assert window.stages["gpu_idle"] < 0.05  # the 0.2 s pause is not the data path's
    assert window.figures()["gpu_idle_frac"] <= 1.0


class Cropped(OnDevice):
    """Batches whose ``finish`` has device work, as their protocol declares."""

    finishes_on_device = True

    def __init__(self, source, device):
        super().__init__(source, device)
        self.finished = 0

    def finish(self, batch):
        self.finished += 1
        batch["image"] = batch["image"][..., 1:-1, 1:-1]
        return batch


def test_the_loop_finishes_batches_whose_protocol_says_they_finish_on_the_device():
    seen = []

    class Recording(DataOnlyStep):
        def __call__(self, batch) -> None:
            seen.append(tuple(batch["image"].shape[-2:]))

    cropped = Cropped(batches(5), torch.device("cpu"))
    result = run_loop(cropped, Recording(), RecordingLogger(),
                      LoopOptions(total_steps=5, warmup_steps=1, log_every=2))
    assert cropped.finished == 5 and seen == [(6, 6)] * 5 and result.steps == 5
    plain = OnDevice(batches(3), torch.device("cpu"))
    assert plain.finishes_on_device is False  # finish is not called: nothing to time
    seen.clear()
    run_loop(plain, Recording(), RecordingLogger(),
             LoopOptions(total_steps=3, warmup_steps=1, log_every=2))
    assert seen == [(8, 8)] * 3
