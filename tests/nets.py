"""A user's own network, as ``model=custom model.target=tests.nets:TwoLayer`` imports it."""

from torch import nn


class TwoLayer(nn.Module):
    def __init__(self, num_classes: int, width: int = 8):
        super().__init__()
        self.width = width
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, stride=2), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.body(x))


def not_a_module(num_classes: int):
    return "a string"


def top_logit(output, batch):
    """A task.postprocess: each image's largest logit (one value per image)."""
    return {"top_logit": output.float().max(dim=1).values}


class Dropping(nn.Module):
    """A small network with dropout: its draws must continue exactly after a resume."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.body(x)


class ConvHead(nn.Module):
    """A fully convolutional classifier: a 1 x 1 convolution after global pooling, its
    scores left unflattened, [B, classes, 1, 1] (a 4-d output, as a segmenter's is)."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, num_classes, 1))

    def forward(self, x):
        return self.body(x)


class PerPixel(nn.Module):
    """Class scores per pixel, [B, classes, H, W]."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.head = nn.Conv2d(3, num_classes, 1)

    def forward(self, x):
        return self.head(x)
