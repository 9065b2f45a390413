"""A seeded Polygraphy-style data loader whose shapes respect the artifact's dynamic ranges."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from moedeploy.export.artifact import Artifact

# Random sizes are drawn inside [min, min(max, cap)]: the full range of a long-context
# decoder would make a comparison slow without testing anything the small sizes do not.
SIZE_CAP = {"batch": 4, "seq": 48, "past_seq": 48}


class ArtifactDataLoader:
    """Iteration 0 uses every dim's `opt`; later iterations draw sizes and values from `seed`.

    Float inputs are standard normal (decoder KV caches too: attention is defined for any
    keys and values); token ids are uniform over the vocabulary.
    """

    def __init__(self, artifact: Artifact, iterations: int = 4, seed: int = 0) -> None:
        if iterations < 1:
            raise ValueError(f"--iterations must be >= 1, got {iterations}")
        self.artifact = artifact
        self.iterations = iterations
        self.seed = seed

    def __len__(self) -> int:
        return self.iterations

    def sizes(self, iteration: int) -> dict[str, int]:
        ranges = self.artifact.manifest["dynamic_ranges"]
        if iteration == 0:
            return {name: r["opt"] for name, r in ranges.items()}
        rng = np.random.default_rng([self.seed, iteration, 1])
        sizes = {
            name: int(rng.integers(r["min"], max(r["min"], min(r["max"], SIZE_CAP.get(name, r["max"]))) + 1))
            for name, r in ranges.items()
        }
        # A decoder step sees past + new positions: together they must fit its RoPE table.
        limit = self.artifact.manifest["config"].get("max_positions")
        if limit and "past_seq" in sizes and "seq" in sizes:
            sizes["past_seq"] = max(ranges["past_seq"]["min"], min(sizes["past_seq"], limit - sizes["seq"]))
        return sizes

    def __getitem__(self, iteration: int) -> OrderedDict[str, np.ndarray]:
        if not 0 <= iteration < self.iterations:
            raise IndexError(iteration)
        sizes = self.sizes(iteration)
        rng = np.random.default_rng([self.seed, iteration, 2])
        feed: OrderedDict[str, np.ndarray] = OrderedDict()
        for spec in self.artifact.manifest["inputs"]:
            shape = [d if isinstance(d, int) else sizes[d] for d in spec["shape"]]
            if spec["dtype"] == "int64":
                vocab = self.artifact.manifest["config"].get("vocab_size", 2)
                feed[spec["name"]] = rng.integers(0, vocab, size=shape, dtype=np.int64)
            else:
                dtype = np.float32 if spec["dtype"] == "bfloat16" else np.dtype(spec["dtype"])
                feed[spec["name"]] = rng.standard_normal(shape).astype(dtype)
        return feed

    def __iter__(self) -> Iterator[OrderedDict[str, np.ndarray]]:
        for i in range(self.iterations):
            yield self[i]
