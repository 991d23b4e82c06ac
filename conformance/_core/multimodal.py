"""Images in the harness's requests: where their placeholder tokens go and the features vLLM gets.

A request of a multimodal axis may carry images (``AddRequest.images``): pairs of an image name
from ``IMAGES`` and the position among the request's own tokens where the client put it. The
prompt the engine receives has each image expanded into its placeholder tokens
(``IMAGE_TOKEN``, as many as the image's encoder output has embeddings), as a multimodal input
processor expands them; the request then carries one feature per image (``mm_features``), whose
identifier keys vLLM's encoder cache and the prefix cache's block hashes. Two requests showing
the same image share its encoder output; the catalogue's ``cat-resized`` reuses ``cat``'s
identifier with another size, as a client reusing one multimodal UUID for different content
does (which vLLM 0.33 rejects on an encoder-cache hit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The image placeholder token of the bundled multimodal model (``image_token_index``).
IMAGE_TOKEN = 500

# Image name -> (identifier, embeddings). 16 is the most the model's vision tower makes for one
# image (so vLLM sizes the encoder budget at the token budget, at least 16); smaller images
# stand in for the variable sizes of models that resize.
IMAGES: dict[str, tuple[str, int]] = {
    "cat": ("img-cat", 16),
    "dog": ("img-dog", 16),
    "bird": ("img-bird", 16),
    "chart": ("img-chart", 8),
    "map": ("img-map", 12),
    "icon": ("img-icon", 4),
    "cat-resized": ("img-cat", 8),
}

Placement = tuple[str, int, int]  # (identifier, offset in the prompt, embeddings)


def expand(own: Sequence[int], images: Sequence[tuple[str, int]]) -> list[int]:
    """The request's own tokens with each image's placeholder tokens inserted at its position
    (clamped to the end; images at one position keep their order)."""
    out: list[int] = []
    at = 0
    for name, pos in sorted(images, key=lambda im: min(im[1], len(own))):
        pos = min(pos, len(own))
        out.extend(own[at:pos])
        out.extend([IMAGE_TOKEN] * IMAGES[name][1])
        at = pos
    out.extend(own[at:])
    return out


def placements(own_len: int, images: Sequence[tuple[str, int]], prompt_len: int) -> list[Placement]:
    """Where ``images`` sit in a prompt of ``prompt_len`` tokens whose last ``own_len`` tokens
    before expansion are the request's own (the rest is a shared prefix), in prompt order."""
    total = sum(IMAGES[name][1] for name, _ in images)
    head = prompt_len - own_len - total
    out: list[Placement] = []
    shift = 0
    for name, pos in sorted(images, key=lambda im: min(im[1], own_len)):
        identifier, size = IMAGES[name]
        out.append((identifier, head + min(pos, own_len) + shift, size))
        shift += size
    return out


def feature_specs(places: Sequence[Placement], with_data: bool = False) -> list[Any]:
    """vLLM's ``MultiModalFeatureSpec`` for each placement. No data by default: the harness runs
    no encoder, as an engine whose processor cache already holds the item sends none. With
    ``with_data``, each carries a processed item as a client without that cache sends it (what
    a scheduler built for Model Runner V2 tells its worker to install)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [
        MultiModalFeatureSpec(
            data=_processed(size) if with_data else None,
            modality="image",
            # A string of its own per feature, as an engine decoding the request off its socket
            # holds them: vLLM's sha256 block hash pickles the extra keys, and pickle writes a
            # string met twice as one object (one image twice in a block) as a back-reference,
            # so one shared object would hash that block differently from the engine's.
            identifier=identifier.encode().decode(),
            mm_position=PlaceholderRange(offset=offset, length=size),
            mm_hash=identifier,
        )
        for identifier, offset, size in places
    ]


def describe(images: Sequence[tuple[str, int]]) -> str:
    return ",".join(f"{name}@{pos}" for name, pos in images)


# The per-request draws of the multimodal axes (``AddRequest.images``), no image first: one
# image, two (neighbours, or one image twice), three that fill the 48-token encoder budget, a
# reused identifier. Their distinct images need 88 slots of a 48-slot cache, so entries no
# running request uses are evicted.
IMAGE_DRAWS: tuple[tuple[tuple[str, int], ...], ...] = (
    (),
    (("cat", 0),),
    (("dog", 3),),
    (("bird", 1),),
    (("chart", 10),),
    (("map", 6),),
    (("cat", 2), ("dog", 20)),
    (("icon", 0), ("icon", 5)),
    (("dog", 0), ("chart", 0)),
    (("bird", 0), ("map", 8), ("icon", 30)),
    (("cat", 0), ("dog", 1), ("bird", 2)),
    (("cat-resized", 4),),
)


def _processed(size: int) -> Any:
    """A processed image as vLLM's processor hands it on: its pixel values, one row per
    placeholder token (zeros: nothing encodes them here)."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    pixels = MultiModalFieldElem(data=torch.zeros(size, 4), field=MultiModalBatchedField())
    return MultiModalKwargsItem({"pixel_values": pixels})
