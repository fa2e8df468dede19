"""task.augment on the batch (runner/data/device/augment.py): RandAugment / TrivialAugment grouped by
operation give torchvision's per-image results with kernel calls that do not grow with the
batch; MixUp and CutMix draw on the device with no boolean-mask indexing or host reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.transforms.v2 import RandAugment, TrivialAugmentWide

from runner.config.schema import AugmentConfig, AutoAugmentName
from runner.data.decode.crops import BatchAugment
from runner.data.device import augment as T
from runner.data.device.augment import (
    NUM_BINS,
    OP_NAMES,
    PARAMS,
    TrainAugment,
    apply_ops,
    op_parameters,
)

SPACES = {"randaugment": RandAugment, "trivialaugment": TrivialAugmentWide}


def images(n: int = 6, h: int = 32, w: int = 40, seed: int = 0) -> torch.Tensor:
    """Random uint8 images, with the cases blends and histograms treat apart: a grey one
    (r == g == b: image == its greyscale), a flat one, a low-contrast one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)
    if n >= 4:
        x[1] = x[1, :1].expand(3, h, w)
        x[2] = 77
        x[3] = torch.randint(100, 110, (3, h, w), dtype=torch.uint8, generator=g)
    return x


def torchvision_op(image: torch.Tensor, op: str, magnitude: float) -> torch.Tensor:
    """What torchvision's v2 auto-augment applies for ``op`` at ``magnitude``."""
    t = RandAugment()
    return t._apply_image_or_video_transform(image, op, magnitude,
                                             interpolation=t.interpolation, fill=t._fill)


def magnitudes(space: str, op: str, h: int, w: int) -> list[float]:
    """Every magnitude torchvision can draw for ``op``: each bin, either sign."""
    fn, signed = SPACES[space]._AUGMENTATION_SPACE[op]
    table = fn(NUM_BINS, h, w)
    if table is None:
        return [0.0]
    values = [float(m) for m in table]
    return values + [-m for m in values] if signed else values


def batched(x: torch.Tensor, ops: list[str], mags: list[float]) -> torch.Tensor:
    h, w = x.shape[-2:]
    index = torch.tensor([OP_NAMES.index(op) for op in ops])
    params = torch.tensor([op_parameters(op, m, h, w) for op, m in zip(ops, mags)])
    return apply_ops(x, index, params)


@pytest.mark.slow
@pytest.mark.parametrize("size", [(32, 40), (32, 32)])
@pytest.mark.parametrize("space", ["randaugment", "trivialaugment"])
@pytest.mark.parametrize("op", OP_NAMES)
def test_each_operation_on_a_group_equals_torchvision_image_by_image(op, space, size):
    """Every magnitude of the space (each bin, each sign), six per group, mixed within the
    group; 32x32 for rotate's square fast paths (90 and 270 degrees: rot90)."""
    h, w = size
    mags = magnitudes(space, op, h, w)
    mags = [mags[k % len(mags)] for k in range(-(-len(mags) // 6) * 6)]  # groups of 6
    for start in range(0, len(mags), 6):
        x = images(6, h, w, seed=start)
        chunk = mags[start:start + 6]
        got = batched(x, [op] * 6, chunk)
        for i, m in enumerate(chunk):
            expected = torchvision_op(x[i], op, m)
            assert torch.equal(got[i], expected), (op, m, (got[i] != expected).sum())


@pytest.mark.slow
@pytest.mark.parametrize("space", ["randaugment", "trivialaugment"])
def test_images_of_one_batch_each_go_through_their_own_operations(space):
    """A mixed batch, two rounds: grouped, applied and scattered back to the right images."""
    g = torch.Generator().manual_seed(1)
    n, h, w = 40, 24, 28
    x = images(n, h, w, seed=3)
    rounds = [[OP_NAMES[int(k)] for k in torch.randint(len(OP_NAMES), (n,), generator=g)]
              for _ in range(2)]
    mags = [[(lambda ms: ms[int(torch.randint(len(ms), (), generator=g))])(
        magnitudes(space, op, h, w)) for op in ops] for ops in rounds]
    index = torch.tensor([[OP_NAMES.index(op) for op in ops] for ops in rounds])
    params = torch.tensor([[op_parameters(op, m, h, w) for op, m in zip(ops, ms)]
                           for ops, ms in zip(rounds, mags)])
    got = apply_ops(x, index, params)
    for i in range(n):
        expected = x[i]
        for r in range(2):
            expected = torchvision_op(expected, rounds[r][i], mags[r][i])
        assert torch.equal(got[i], expected), (i, [ops[i] for ops in rounds])


def flat_like(n: int, h: int = 16, w: int = 16) -> TensorDict:
    x = images(1, h, w, seed=5).expand(n, 3, h, w).clone()
    return TensorDict({"image": x, "label": torch.zeros(n, dtype=torch.long)}, batch_size=[n])


@pytest.mark.parametrize("auto", ["randaugment", "trivialaugment"])
def test_train_augment_draws_torchvisions_space_and_applies_it_per_image(auto, monkeypatch):
    """Through TrainAugment: each image's drawn parameters are those of one of torchvision's
    magnitudes for its operation, and its result torchvision's for that magnitude."""
    seen = []
    real = T.apply_ops

    def spy(x, ops, params):
        seen.append((ops.clone(), params.clone()))
        return real(x, ops, params)

    monkeypatch.setattr(T, "apply_ops", spy)
    n, h, w = 32, 20, 24
    batch = flat_like(n, h, w)
    original = batch["image"].clone()
    TrainAugment(AugmentConfig(auto=AutoAugmentName(auto), ops=2, magnitude=12), seed=3)(batch)
    (ops, params), = seen
    assert ops.shape == ((2, n) if auto == "randaugment" else (1, n))
    bins = [12] if auto == "randaugment" else range(NUM_BINS)
    drawn = set()
    for i in range(n):
        expected = original[i]
        for r in range(ops.shape[0]):
            op = OP_NAMES[int(ops[r, i])]
            fn, signed = SPACES[auto]._AUGMENTATION_SPACE[op]
            table = fn(NUM_BINS, h, w)
            candidates = [0.0] if table is None else [
                s * float(table[b]) for b in bins for s in ((1, -1) if signed else (1,))]
            m = next(m for m in candidates
                     if op_parameters(op, m, h, w) == params[r, i].tolist())
            drawn.add((op, m))
            expected = torchvision_op(expected, op, m)
        assert torch.equal(batch["image"][i], expected)
    assert len({op for op, _ in drawn}) >= 8  # operations drawn per image, not per batch
    if auto == "trivialaugment":
        assert len(drawn) >= 20  # and magnitudes too


def count_kernels(monkeypatch) -> dict[str, int]:
    calls = dict.fromkeys(T._KERNELS, 0)
    for name, fn in list(T._KERNELS.items()):
        def counted(x, p, name=name, fn=fn):
            calls[name] += 1
            return fn(x, p)
        monkeypatch.setitem(T._KERNELS, name, counted)
    return calls


@pytest.mark.slow
def test_operation_calls_per_batch_do_not_grow_with_the_batch(monkeypatch):
    calls = count_kernels(monkeypatch)
    per_batch = {}
    for n in (8, 64):
        for key in calls:
            calls[key] = 0
        TrainAugment(AugmentConfig(auto=AutoAugmentName.randaugment, ops=2), seed=0)(
            flat_like(n))
        assert max(calls.values()) <= 2  # at most once per round for each kernel
        per_batch[n] = sum(calls.values())
    assert per_batch[64] <= 2 * len(calls) and per_batch[64] > per_batch[8] / 2
    # the per-image path this replaced: torchvision's operation once per image and round
    applied = []
    real = RandAugment._apply_image_or_video_transform

    def counted(self, *args, **kwargs):
        applied.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RandAugment, "_apply_image_or_video_transform", counted)
    old = RandAugment(num_ops=2)
    for n in (8, 64):
        applied.clear()
        torch.stack([old(image) for image in flat_like(n)["image"]])
        assert len(applied) == 2 * n


class OpLog(TorchDispatchMode):
    """The aten operations run inside, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bool_indexing = self.moves = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops.append(name)
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
            self.bool_indexing += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                      for i in indices)
        self.moves += name == "_to_copy" and kwargs.get("device") is not None
        return func(*args, **kwargs)


def aten_ops(fn) -> OpLog:
    with OpLog() as log:
        fn()
    return log


@pytest.mark.slow
def test_aten_operations_per_batch_depend_on_the_operations_not_the_batch():
    def run(n, per_image=False):
        batch = flat_like(n, 8, 8)
        if per_image:
            old = TrivialAugmentWide()
            torch.manual_seed(0)
            return lambda: torch.stack([old(image) for image in batch["image"]])
        return lambda: TrainAugment(AugmentConfig(auto=AutoAugmentName.trivialaugment),
                                    seed=0)(batch)

    assert len(aten_ops(run(256)).ops) == len(aten_ops(run(512)).ops)  # every group drawn
    assert len(aten_ops(run(512, True)).ops) > 1.8 * len(aten_ops(run(256, True)).ops)


# --- MixUp and CutMix -------------------------------------------------------------------------

COLOURS = [0, 40, 80, 120, 160, 200, 240, 20, 60, 100, 140, 180]


def flat_batch(h: int = 24, w: int = 32) -> TensorDict:
    n = len(COLOURS)
    image = torch.tensor(COLOURS, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, h, w)
    return TensorDict({"image": image.contiguous(), "label": torch.arange(n)}, batch_size=[n])


def check_pasted_box(image: torch.Tensor, own: int, partner: int, mix: float) -> bool:
    """image: one flat colour ``own`` but for a rectangle of ``partner``'s, whose share of the
    image is exactly ``mix``; False where the image is not cut at all."""
    h, w = image.shape[-2:]
    assert (image == image[:1]).all()  # every channel alike
    pasted = image[0] == partner
    assert ((image[0] == own) | pasted).all()
    count = int(pasted.sum())
    assert float(torch.tensor(count, dtype=torch.float32) / (h * w)) == mix
    if count:
        rows, cols = pasted.any(1).nonzero().flatten(), pasted.any(0).nonzero().flatten()
        top, bottom, left, right = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        assert count == (bottom - top) * (right - left)  # a filled rectangle
        assert pasted[top:bottom, left:right].all()
    return count > 0


def test_cutmix_pastes_a_rectangle_of_the_partner_weighted_by_its_exact_share():
    aug = TrainAugment(AugmentConfig(cutmix=1.0), seed=0)
    shares, clipped = [], 0
    for _ in range(6):
        batch = flat_batch()
        aug(batch)
        mix, label_b = batch["mix"], batch["label_b"]
        assert sorted(label_b.tolist()) == list(range(len(COLOURS)))  # one permutation
        for i, own in enumerate(COLOURS):
            j = int(label_b[i])
            if j == i:
                assert (batch["image"][i] == own).all()
                continue
            image = batch["image"][i]
            if check_pasted_box(image, own, COLOURS[j], float(mix[i])):
                shares.append(float(mix[i]))
                pasted = image[0] == COLOURS[j]
                clipped += bool(pasted[0].any() | pasted[-1].any() | pasted[:, 0].any()
                                | pasted[:, -1].any())
    assert len(shares) > 40 and len(set(shares)) > 20 and clipped > 5


def test_cutmix_pastes_from_the_original_images_when_mixup_is_on_too():
    aug = TrainAugment(AugmentConfig(mixup=0.4, cutmix=1.0, mix_prob=0.8), seed=1)
    kinds = {"cut": 0, "blend": 0, "none": 0}
    for _ in range(4):
        batch = flat_batch()
        aug(batch)
        for i, own in enumerate(COLOURS):
            image, j, mix = batch["image"][i], int(batch["label_b"][i]), float(batch["mix"][i])
            flat = bool((image == image[0, 0, 0]).all())
            if not flat:  # CutMix: the partner's original colour, not a MixUp blend
                kinds["cut"] += check_pasted_box(image, own, COLOURS[j], mix)
            elif mix == 0:  # left alone (or a box clipped to nothing)
                kinds["none"] += 1
                assert (image == own).all()
            else:  # MixUp
                kinds["blend"] += 1
                expected = (1 - mix) * own + mix * COLOURS[j]
                assert abs(int(image[0, 0, 0]) - expected) <= 1
    assert min(kinds.values()) > 0, kinds


FORBIDDEN = {"nonzero", "nonzero_static", "masked_select", "masked_scatter", "masked_scatter_",
             "_local_scalar_dense", "item", "is_nonzero", "lift_fresh", "lift_fresh_copy"}


@pytest.mark.parametrize("cfg", [{"mixup": 0.4}, {"cutmix": 1.0},
                                 {"mixup": 0.4, "cutmix": 1.0, "mix_prob": 0.7}])
def test_mix_reads_nothing_back_and_indexes_with_no_boolean_mask(cfg):
    """On the CPU: no op that syncs a device (nonzero, boolean-mask indexing, item) and no
    tensor made from host data or copied across (torch.tensor, .to) while mixing."""
    aug = TrainAugment(AugmentConfig(**cfg), seed=0)
    batch = flat_batch()
    x = batch["image"].float() / 255
    log = aten_ops(lambda: aug._mix(x, batch))
    assert not FORBIDDEN & set(log.ops), sorted(FORBIDDEN & set(log.ops))
    assert log.bool_indexing == 0 and log.moves == 0
    assert "where" in log.ops and batch["mix"].shape == (len(COLOURS),)


def test_the_same_step_gives_the_same_augmentation_and_the_next_step_another():
    cfg = AugmentConfig(auto=AutoAugmentName.randaugment, color_jitter=0.3, erasing=0.5,
                        mixup=0.4, cutmix=1.0, mix_prob=0.8)

    def run(start: int) -> TensorDict:
        batch = flat_like(16, 20, 24)
        batch["label"] = torch.arange(16)
        TrainAugment(cfg, seed=7, start_step=start)(batch)
        return batch

    a, b, c = run(3), run(3), run(4)
    for key in ("image", "label_b", "mix"):
        assert torch.equal(a[key], b[key])
    assert not torch.equal(a["image"], c["image"]) and not torch.equal(a["mix"], c["mix"])
    # a resumed run replays: the second call of a run started at 3 is step 4
    aug, first, second = TrainAugment(cfg, seed=7, start_step=3), flat_like(16, 20, 24), None
    first["label"] = torch.arange(16)
    aug(first)
    second = flat_like(16, 20, 24)
    second["label"] = torch.arange(16)
    aug(second)
    assert torch.equal(second["image"], c["image"]) and torch.equal(second["mix"], c["mix"])


def test_parameters_are_float32_numbers_of_a_fixed_width():
    for op in OP_NAMES:
        p = op_parameters(op, 0.3, 20, 24)
        assert len(p) == PARAMS
        assert torch.tensor(p, dtype=torch.float32).tolist() == p


# --- on a GPU (pytest -m cuda) ------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("size", [(32, 40), (224, 224)])
@pytest.mark.parametrize("space", ["randaugment", "trivialaugment"])
def test_on_cuda_each_operation_equals_torchvision_image_by_image(space, size):
    h, w = size
    for op in OP_NAMES:
        mags = magnitudes(space, op, h, w)
        n = len(mags)
        x = images(n, h, w, seed=n).cuda()
        got = batched(x, [op] * n, mags)
        for i, m in enumerate(mags):
            expected = torchvision_op(x[i], op, m)
            assert torch.equal(got[i], expected), (op, m, int((got[i] != expected).sum()))


@pytest.mark.cuda
def test_on_cuda_a_step_neither_waits_for_the_device_nor_copies_but_its_parameters():
    cfg = AugmentConfig(auto=AutoAugmentName.trivialaugment, mixup=0.4, cutmix=1.0,
                        mix_prob=0.8)
    aug = TrainAugment(cfg, seed=0)

    def batch() -> TensorDict:
        b = flat_batch(64, 80)
        return TensorDict({"image": b["image"].cuda(), "label": b["label"].cuda()},
                          batch_size=b.batch_size)

    aug(batch())  # warm: the pinned buffer, the kernels
    torch.cuda.synchronize()
    b, step = batch(), batch()
    x = b["image"].float() / 255
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        log = aten_ops(lambda: aug._mix(x, b))
        whole = aten_ops(lambda: aug(step))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert log.moves == 0 and not FORBIDDEN & set(log.ops) and log.bool_indexing == 0
    assert whole.moves == 1  # the step's operation parameters, one pinned asynchronous copy
    assert not FORBIDDEN & set(whole.ops) and whole.bool_indexing == 0


def test_colour_jitter_and_erasing_draw_on_the_device_and_read_nothing_back():
    """color_jitter and erasing: no host mask, no value read back, nothing copied across
    (each a sync per step on a GPU)."""
    from runner.data.device.augment import colour_jitter, erase

    x = images(8).float() / 255
    for fn in (lambda: colour_jitter(x, 0.4), lambda: erase(x, 0.5)):
        log = aten_ops(fn)
        assert not FORBIDDEN & set(log.ops), sorted(FORBIDDEN & set(log.ops))
        assert log.bool_indexing == 0 and log.moves == 0


def test_colour_jitter_follows_torchvisions_formulas():
    """One step at a time (the other factors neutral): brightness multiplies, contrast and
    saturation blend with the greyscale mean and the greyscale, as torchvision's do."""
    import torchvision.transforms.v2.functional as TF

    from runner.data.device.augment import colour_jitter

    x = images(4).float() / 255
    torch.manual_seed(3)
    out = colour_jitter(x, 0.0)  # every factor neutral, hue 0: the image itself
    assert torch.allclose(out, x, atol=1e-5)
    for k, tv in ((0, TF.adjust_brightness), (1, TF.adjust_contrast),
                  (2, TF.adjust_saturation)):
        torch.manual_seed(5)
        factors = torch.empty(3, 4, 1, 1, 1).uniform_(0.6, 1.4)
        torch.manual_seed(5)
        got = colour_jitter_only(x, k, 0.4)
        for i in range(4):
            expected = tv(x[i], float(factors[k, i]))
            assert torch.allclose(got[i], expected, atol=1e-5), (k, i)


def colour_jitter_only(x: torch.Tensor, step: int, strength: float) -> torch.Tensor:
    """colour_jitter with one step kept: the factors as it draws them, the others made
    neutral by running it with the order forced."""
    from unittest import mock

    from runner.data.device import augment as transforms

    with mock.patch.object(transforms.torch, "randperm",
                           lambda n: torch.tensor([step])):
        return transforms.colour_jitter(x, strength)


def test_erasing_zeroes_one_rectangle_per_chosen_image():
    from runner.data.device.augment import erase

    x = torch.ones(64, 3, 20, 30)
    torch.manual_seed(0)
    out = erase(x, 0.5)
    erased = (out == 0).all(dim=1)  # (N, H, W): every channel zero
    chosen = erased.flatten(1).any(dim=1)
    assert 10 < int(chosen.sum()) < 54  # about half
    for k in torch.nonzero(chosen).flatten().tolist():
        rows, cols = erased[k].any(dim=1), erased[k].any(dim=0)
        # a rectangle: its bounding box is all zeros
        assert int(erased[k].sum()) == int(rows.sum()) * int(cols.sum())
        share = float(erased[k].float().mean())
        assert 0.005 < share < 0.5
    assert torch.equal(out[~chosen], x[~chosen])


class HostTensors(TorchDispatchMode):
    """The tensors an operation is handed that came from neither the inputs nor an earlier
    operation: made from Python values on the host (``x[1, 1] = 0.5`` lifts 0.5 to a CPU
    tensor, a host copy that waits for a GPU, as ``torch.tensor(...)`` would)."""

    def __init__(self, *inputs: torch.Tensor):
        super().__init__()
        self.known = list(inputs)  # kept alive: their ids stay theirs
        self.host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ids = {id(t) for t in self.known}
        handed = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]
        self.host += [func._schema.name for t in handed if id(t) not in ids]
        out = func(*args, **kwargs)
        self.known += handed + [o for o in torch.utils._pytree.tree_leaves(out)
                                if isinstance(o, torch.Tensor)]
        return out


@pytest.mark.parametrize("name", sorted(T._KERNELS))
def test_no_operation_kernel_makes_a_tensor_from_host_values(name):
    """Each RandAugment/TrivialAugment kernel: every tensor an operation gets is an input or
    an earlier operation's output, none made from a Python value (on a GPU a host copy:
    the selfcheck's sync row on an H200 found Sharpness's ``kernel[1, 1] = 5 / 13``)."""
    x, p = images(4, 16, 20), torch.rand(4, T.PARAMS)
    with HostTensors(x, p) as log:
        out = T._KERNELS[name](x, p)
    assert out.shape == x.shape and log.host == [], log.host


@pytest.mark.parametrize("cfg", [{"mixup": 0.4}, {"cutmix": 1.0}, {"color_jitter": 0.4},
                                 {"erasing": 0.5}])
def test_the_float_augmentations_make_no_tensor_from_host_values(cfg):
    from runner.data.device.augment import colour_jitter, erase

    aug = TrainAugment(AugmentConfig(**cfg), seed=0)
    batch = flat_batch()
    x = batch["image"].float() / 255
    run = {"color_jitter": lambda: colour_jitter(x, 0.4), "erasing": lambda: erase(x, 0.5)
           }.get(next(iter(cfg)), lambda: aug._mix(x, batch))
    run()  # once before: a library imported on first use builds its constants
    with HostTensors(x, *batch.values()) as log:
        run()
    assert log.host == [], log.host


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(T._KERNELS))
def test_on_cuda_no_operation_kernel_waits_for_the_device(name):
    x = images(4, 16, 20).cuda()
    p = T.GroupedAutoAugment(trivial=True).draw(4, 16, 20)[1][0].cuda()
    T._KERNELS[name](x, p)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = T._KERNELS[name](x, p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_the_hue_shift_is_torchvisions_adjust_hue_per_image_with_no_host_value(dtype):
    """adjust_hue (colour_jitter's hue step, written in torch): each
    image of the batch shifted by its own factor, within 1/255 of torchvision's v2
    adjust_hue on uint8 and float images, including the grey, flat and low-contrast ones and
    factors of both signs up to +-0.5; no tensor made from a host value inside it."""
    import torchvision.transforms.v2.functional as TF

    from runner.data.device.augment import adjust_hue

    x = images(8, 24, 28, seed=4)
    if dtype == torch.float32:  # values off the 1/255 grid too
        x = torch.cat([x[:4].float() / 255, torch.rand(4, 3, 24, 28)])
    factors = torch.tensor([-0.5, -0.31, -0.04, 0.0, 0.07, 0.25, 0.42, 0.5])
    out = adjust_hue(x, factors)
    assert out.dtype == dtype and out.shape == x.shape
    scale = 255 if dtype == torch.float32 else 1
    for i, f in enumerate(factors.tolist()):
        expected = TF.adjust_hue(x[i], f)
        gap = float((out[i].double() - expected.double()).abs().max()) * scale
        assert gap <= 1 + 1e-6, (i, f, gap)
    assert torch.equal(adjust_hue(x, 0.25), adjust_hue(x, torch.full((8,), 0.25)))  # a number
    with HostTensors(x, factors) as log:
        adjust_hue(x, factors)
    assert log.host == [], log.host


CPU = torch.device("cpu")

def test_batched_augmentation_matches_a_per_image_reference():
    torch.manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 40, 48), dtype=torch.uint8)
    aug = BatchAugment((40, 48))
    boxes = aug.boxes(16, 40, 48, CPU)
    out = aug.apply(images, boxes)
    assert out.shape == (16, 3, 40, 48) and out.dtype == torch.uint8
    for k in range(16):
        t, left = int(boxes.top[k]), int(boxes.left[k])
        h, w = int(boxes.height[k]), int(boxes.width[k])
        assert 0 <= t and t + h <= 40 and 0 <= left and left + w <= 48
        crop = images[k : k + 1, :, t : t + h, left : left + w].float()
        ref = F.interpolate(crop, size=(40, 48), mode="bilinear", align_corners=False)[0]
        ref = ref.round().clamp(0, 255)
        if boxes.flip[k]:
            ref = ref.flip(-1)
        assert (out[k].float() - ref).abs().max() <= 1.0  # float rounding only
    assert boxes.flip.any() and not boxes.flip.all()
    assert len({(int(a), int(b)) for a, b in zip(boxes.height, boxes.width)}) > 8

def test_augmentation_draws_on_the_device_with_no_host_round_trip(monkeypatch):
    aug = BatchAugment((24, 24))
    calls = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or real_item(self))
    aug(torch.randint(0, 256, (8, 3, 24, 24), dtype=torch.uint8))
    assert calls == []  # no .item(): nothing leaves the device per image


@pytest.mark.parametrize("auto", ["trivialaugment", "none"])
def test_a_fixed_seed_gives_equal_images_on_the_cpu_the_device_or_both(auto):
    """task.augment.on=cpu|device|both: the same draws wherever each half runs, so on a CPU
    run (one generator) the images and mix labels are equal; in ``both`` the host half
    moves pixels only (a geometric operation, or nothing) and the device half the rest."""
    from runner.config.schema import AugmentOn

    base = dict(auto=AutoAugmentName(auto), color_jitter=0.4, erasing=0.5, mixup=0.4,
                cutmix=1.0, mix_prob=0.8)
    source = TensorDict({"image": images(8, 24, 28, seed=5),
                         "label": torch.arange(8) % 3}, batch_size=[8])
    out = {}
    for on in AugmentOn:
        aug = TrainAugment(AugmentConfig(**base, on=on), seed=11, start_step=4)
        batch = source.clone()
        assert aug.on_host == (on is AugmentOn.cpu or (on is AugmentOn.both and auto != "none"))
        assert aug.on_device == (on is not AugmentOn.cpu)
        aug.host(batch)
        if on is AugmentOn.device:
            assert torch.equal(batch["image"], source["image"])  # nothing on the host
        aug(batch)
        out[on] = batch
    for on in (AugmentOn.cpu, AugmentOn.both):
        assert torch.equal(out[on]["image"], out[AugmentOn.device]["image"]), on
        assert torch.equal(out[on]["mix"], out[AugmentOn.device]["mix"])
        assert torch.equal(out[on]["label_b"], out[AugmentOn.device]["label_b"])
    assert not torch.equal(out[AugmentOn.device]["image"], source["image"])


def test_in_both_the_host_half_applies_the_geometric_operations_alone(monkeypatch):
    from runner.config.schema import AugmentOn
    from runner.data.device import augment

    seen = []
    real = augment.apply_ops
    monkeypatch.setattr(augment, "apply_ops",
                        lambda x, ops, params: seen.append(ops.clone()) or real(x, ops, params))
    aug = TrainAugment(AugmentConfig(auto=AutoAugmentName.trivialaugment, color_jitter=0.3,
                                     on=AugmentOn.both), seed=2)
    batch = TensorDict({"image": images(64, 16, 16), "label": torch.zeros(64, dtype=torch.long)},
                       batch_size=[64])
    aug.host(batch)
    aug(batch)
    host, device = seen
    geometric = torch.isin(host, augment.GEOMETRIC_OPS)
    identity = OP_NAMES.index("Identity")
    assert geometric.any() and ((host == identity) | geometric).all()  # the host: geometric
    assert not torch.isin(device, augment.GEOMETRIC_OPS).any()  # the device: the rest
    # one draw split in two: each image's operation on exactly one side
    assert ((host == identity) | (device == identity)).all()


@pytest.mark.slow
def test_where_augmentation_runs_is_one_sweep(tmp_path, cache_dir):
    """python -m runner -m task.augment.on=cpu,device,both: on the CPU the device stage has
    nothing to do (the timeline shows the host's augment span); on the device it is timed
    as the augment stage; a storage that crops on the device refuses the host side."""
    import json

    from runner.common.errors import ConfigError
    from tests.conftest import SMALL_DATASET, run_in_process

    base = [*SMALL_DATASET, "logger=none", "diagnose=false", "run.steps=6",
            "task.augment.auto=trivialaugment", "task.augment.color_jitter=0.3"]
    cpu = run_in_process(*base, "task.augment.on=cpu", run_dir=tmp_path / "cpu")
    device = run_in_process(*base, "task.augment.on=device", run_dir=tmp_path / "device")
    assert device["augment_frac"] > 0 and not cpu.get("augment_frac")
    spans = json.loads((tmp_path / "cpu" / "timeline.json").read_text())["spans"]
    assert any(s["stage"] == "augment" and s["lane"] == "main" for s in spans)
    both = run_in_process(*base, "task.augment.on=both", run_dir=tmp_path / "both")
    assert both["augment_frac"] > 0 and both["status"] == "ok"
    with pytest.raises(ConfigError, match="task.augment.on=cpu augments host batches"):
        run_in_process(*base, "loader=memmap", "dataset.crop=random", "task.augment.on=cpu",
                       run_dir=tmp_path / "memmap")
