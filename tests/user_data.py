"""A user's own Dataset, as ``dataset.target=tests.user_data:eighteen`` imports it."""

import torch
from torch.utils.data import Dataset


class Eighteen(Dataset):
    """18 uint8 CHW images of two sizes, in 3 classes."""

    classes = ["a", "b", "c"]

    def __len__(self) -> int:
        return 18

    def __getitem__(self, i: int):
        size = (40, 60) if i % 2 else (300, 200)
        return torch.full((3, *size), 10 * i, dtype=torch.uint8), i % 3


def eighteen() -> Eighteen:
    return Eighteen()
