"""Idefics3's connector: pixel shuffle folds each scale×scale block of neighbouring patches into one
vector (scale² times wider, scale² times fewer), then a linear map projects it to the text model's
width."""

import torch
from torch import nn


def pixel_shuffle(features: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side², width] patch features → [tiles, (side / scale)², width · scale²]. A block's
    vector is its rows in order, each row's patches in order; blocks follow row-major, as HF's
    connector lays them out."""
    tiles, patches, width = features.shape
    side = int(patches**0.5)
    blocks = side // scale
    grid = features.view(tiles, blocks, scale, blocks, scale, width)
    return grid.permute(0, 1, 3, 2, 4, 5).reshape(tiles, blocks * blocks, scale * scale * width)


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)


class PixelShuffleConnector(nn.Module):
    def __init__(self, vision_width: int, text_width: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = ModalityProjection(vision_width * scale * scale, text_width)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, vision width] → [tiles, patches / scale², text width]."""
        return self.modality_projection(pixel_shuffle(features, self.scale))
