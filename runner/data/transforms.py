"""``task.augment``: training augmentation beyond the crop, per image, on the run's device.

The random-resized crop and flip happen where each storage crops (while decoding on the
CPU for folder and packed; on the device for memmap and ram, runner/data/augment.py). What
``task.augment`` adds runs on the device the batch was moved to, after the crop, each
operation with its own random draw per image:

- ``auto=randaugment|trivialaugment``: torchvision's v2 RandAugment / TrivialAugmentWide on
  the uint8 image, called image by image (a call on the batch would draw one operation for
  the whole batch; kornia's auto-augment policies also pick their operations per batch);
- ``color_jitter``: kornia's ColorJitter (batched, parameters per image);
- ``erasing``: kornia's RandomErasing (batched, a rectangle per image);
- ``mixup`` / ``cutmix``: each image, with probability ``mix_prob``, is mixed with another
  image of the batch, by MixUp or CutMix (a coin per image when both are on). CutMix is
  kornia's RandomCutMixV2 (a box per image from Beta(alpha, alpha)); MixUp is written here,
  because kornia's RandomMixUpV2 draws its weights uniformly, not from MixUp's
  Beta(alpha, alpha). The batch then carries ``label_b`` and ``mix`` (the weight of
  ``label_b``) and the loss is ``(1 - mix) * CE(label) + mix * CE(label_b)``.

Every draw of a batch comes from the torch generator seeded by (seed, rank, step): the same
augmentation for the same batch position on every storage and after a resume
(``torch.random.fork_rng`` keeps the run's own random state untouched).
"""

from __future__ import annotations

import logging

import torch

from runner.config import AugmentConfig, AutoAugmentName

log = logging.getLogger(__name__)


class TrainAugment:
    """``task.augment`` on device batches, one call per training step.

    Args:
        cfg: what to apply, and how strongly.
        seed, rank: the run's seed and this process's rank.
        start_step: the plan's step of the first batch (a resumed run's draws go on there).
    """

    def __init__(self, cfg: AugmentConfig, seed: int, rank: int = 0, start_step: int = 0):
        import kornia.augmentation as K
        from torchvision.transforms import v2

        self.cfg, self.seed, self.rank, self.step = cfg, seed, rank, start_step
        self.auto = None
        if cfg.auto is AutoAugmentName.randaugment:
            self.auto = v2.RandAugment(num_ops=cfg.ops, magnitude=cfg.magnitude)
        elif cfg.auto is AutoAugmentName.trivialaugment:
            self.auto = v2.TrivialAugmentWide()
        s = cfg.color_jitter
        self.colour = K.ColorJitter(s, s, s, s / 4, p=1.0) if s > 0 else None
        self.erasing = K.RandomErasing(p=cfg.erasing) if cfg.erasing > 0 else None
        self.cutmix = K.RandomCutMixV2(beta=cfg.cutmix, data_keys=["input", "class"],
                                       use_correct_lambda=True) if cfg.cutmix > 0 else None

    def describe(self, device: torch.device) -> str:
        parts = [name for name, on in (
            (f"{self.cfg.auto.value}", self.auto is not None),
            (f"colour jitter {self.cfg.color_jitter:g}", self.colour is not None),
            (f"random erasing p={self.cfg.erasing:g}", self.erasing is not None),
            (f"MixUp alpha {self.cfg.mixup:g}", self.cfg.mixup > 0),
            (f"CutMix alpha {self.cfg.cutmix:g}", self.cutmix is not None)) if on]
        return f"{', '.join(parts)}: on {device}, a draw per image"

    def __call__(self, batch) -> None:
        """Augment ``batch`` in place (its image, and the mix labels when mixing)."""
        step, self.step = self.step, self.step + 1
        device = batch["image"].device
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed((self.seed * 1_000_003 + self.rank) * 7_919 + step)
            images = batch["image"]
            if self.auto is not None:
                images = torch.stack([self.auto(image) for image in images])
            if self.colour is None and self.erasing is None and not self.mixes:
                batch["image"] = images
                return
            x = images.float() / 255
            if self.colour is not None:
                x = self.colour(x)
            if self.erasing is not None:
                x = self.erasing(x)
            if self.mixes:
                x = self._mix(x, batch)
            batch["image"] = (x * 255).round_().clamp_(0, 255).to(torch.uint8)

    @property
    def mixes(self) -> bool:
        return self.cfg.mixup > 0 or self.cfg.cutmix > 0

    def _mix(self, x: torch.Tensor, batch) -> torch.Tensor:
        """MixUp or CutMix per image (a coin each when both are on): ``label_b`` and
        ``mix`` (the weight of label_b, 0 for an image left as it is) into ``batch``."""
        n, device = x.shape[0], x.device
        label = batch["label"]
        mixed = torch.rand(n, device=device) < self.cfg.mix_prob
        use_cut = torch.zeros(n, dtype=torch.bool, device=device)
        if self.cutmix is not None:
            use_cut = mixed if self.cfg.mixup <= 0 else mixed & (torch.rand(n, device=device)
                                                                  < 0.5)
        use_up = mixed & ~use_cut
        partner = torch.randperm(n, device=device)
        weight = torch.zeros(n, device=device)
        original = x  # CutMix pastes from images as they were, not from MixUp's blends
        if self.cfg.mixup > 0:
            beta = torch.distributions.Beta(torch.tensor(self.cfg.mixup),
                                            torch.tensor(self.cfg.mixup))
            lam = beta.sample((n,)).to(device, non_blocking=True)
            lam = torch.where(use_up, lam, torch.zeros_like(lam))
            x = x * (1 - lam.view(-1, 1, 1, 1)) + x[partner] * lam.view(-1, 1, 1, 1)
            weight = weight + lam
        label_b = torch.where(use_up, label[partner], label)
        if self.cutmix is not None:
            # rows: (1, n, 3) = (label, the pasted image's label, lambda), lambda being the
            # share of the image left (use_correct_lambda: CutMix's definition)
            cut, rows = self.cutmix(original, label)
            x = torch.where(use_cut.view(-1, 1, 1, 1), cut, x)
            area = 1 - rows[0, :, 2].to(device)
            weight = torch.where(use_cut, area, weight)
            label_b = torch.where(use_cut, rows[0, :, 1].long().to(device), label_b)
        batch["label_b"], batch["mix"] = label_b, weight
        return x
