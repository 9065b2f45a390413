"""Checkpoints: safetensors only (pickle can run code), in our layout or a Hugging Face family's.

A Hugging Face folder is read through its family (`moedeploy.models.families`, by model_type).
Its expert weights come in two layouts:
  per-expert  model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3.weight   (gate/down/up)
              model.layers.{i}.mlp.experts.{j}.gate_proj/up_proj/down_proj.weight
  fused       model.layers.{i}.mlp.experts.gate_up_proj  (E, 2*I, H)  gate rows first
              (GraniteMoE: block_sparse_moe.input_linear.weight), and down_proj (E, H, I)
Both map onto our stacked (E, out, in) expert weights; anything unexpected is an error.
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moedeploy.models.checkpoint_config import (  # noqa: F401 (CheckpointError, config_json_name: re-exported)
    FORMAT,
    CheckpointError,
    config_json_name,
    read_config,
)
from moedeploy.models.config import DecoderConfig
from moedeploy.models.families import Family
from moedeploy.models.families.base import Derived
from moedeploy.utils.io import atomic_directory, atomic_write_json, few_names

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def save_decoder(model: torch.nn.Module, path: str | Path) -> None:
    """config.json + model.safetensors in moedeploy's own tensor names, written atomically."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses aliased tensors
    with atomic_directory(path, owned=_is_moedeploy_checkpoint) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        atomic_write_json(
            tmp / "config.json",
            {"format": FORMAT, "architecture": "MoEDecoder", "config": model.config.to_dict()},
        )


def _is_moedeploy_checkpoint(path: Path) -> bool:
    """A folder `save_decoder` wrote (its config.json says format "moedeploy"): safe to replace."""
    try:
        return json.loads((path / "config.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_decoder(path: str | Path, dtype: torch.dtype | None = None):
    """Build an eval-mode MoEDecoder from a moedeploy folder or a Hugging Face one of a supported family.

    dtype: None keeps the checkpoint's dtype (a bf16 Mixtral stays bf16). Every tensor is read,
    stacked and cast one at a time, so loading needs the model once, not the model twice.
    """
    from moedeploy.models.decoder import MoEDecoder, rotary_embedding

    weights = CheckpointWeights(path)
    config = weights.config
    with torch.device("meta"):
        model = MoEDecoder(config)
    state = {}
    for name in weights.names():
        if config.tie_embeddings and name == "lm_head.weight":
            continue
        tensor = weights.tensor(name)
        state[name] = tensor if dtype is None else tensor.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    # Non-persistent buffers were built on the meta device: rebuild them for real.
    model.rope = rotary_embedding(config)
    return model.eval()


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise CheckpointError(
            f"{path} holds only pickle weights ({', '.join(pickles)}); moedeploy loads safetensors "
            "only, because unpickling can run arbitrary code. Re-save with save_pretrained(..., "
            "safe_serialization=True)"
        )
    raise CheckpointError(f"{path} has no *.safetensors weight files")


def _indexed_file(path: Path, tensor: str) -> str | None:
    """The shard the checkpoint's index names for `tensor` (None: it names none)."""
    named = json.loads((path / INDEX_FILE).read_text())["weight_map"].get(tensor)  # read before by _weight_files
    return named if isinstance(named, str) else None


@dataclass(frozen=True)
class _Part:
    """Where one of our tensors lies in the checkpoint: whole, or rows [start, stop) of dim 1 of
    every expert (a fused gate_up_proj), or one file tensor per expert (stacked on read), or
    computed from file tensors by its family (`derived`)."""

    files: tuple[tuple[Path, str], ...]  # (shard, tensor name): one, or one per expert
    rows: tuple[int, int] | None = None
    per_expert: bool = False  # one file tensor per expert (a single expert included), stacked on read
    derived: Derived | None = None  # made from `files` (its sources, in order)

    def make(self, index: tuple | None = None) -> torch.Tensor:
        """A derived tensor (or, with `index`, the one made from that slice of every source)."""
        assert self.derived is not None
        try:
            return self.derived.make(*(_read(file, key, index) for file, key in self.files))
        except CheckpointError:
            raise
        except ValueError as e:  # e.g. MXFP4 blocks stored in a dtype other than uint8
            raise CheckpointError(f"{', '.join(key for _, key in self.files)}: {e}") from None


class CheckpointWeights:
    """A checkpoint folder read lazily: our tensor names, shapes from the file headers, and each
    tensor (or each expert's slice) read on demand from the memory-mapped shards.

    Nothing is read until asked for, and each read opens its shard only for that read, so
    a model far larger than memory can be streamed one tensor (or one expert) at a time. The
    constructor checks every name and shape against config.json from the headers alone.
    """

    def __init__(self, path: str | Path) -> None:
        from moedeploy.models.decoder import MoEDecoder

        self.path = path = Path(path)
        self.config, family = read_config(path)
        dtypes: dict[str, str] = {}
        if family is None:  # moedeploy's own format: our tensor names
            headers = _read_headers(path, dtypes)
            self._parts = {name: _Part(((file, name),)) for name, (file, _) in headers.items()}
            self._shapes = {name: shape for name, (_, shape) in headers.items()}
        else:
            try:
                self._parts, self._shapes = _hf_parts(_read_headers(path, dtypes), self.config, family)
            except CheckpointError as e:  # name the folder: the weights and its config.json disagree
                raise CheckpointError(f"{path}: {e}") from None
        try:
            _check_float_weights(self._parts, dtypes)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if self.config.tie_embeddings and "lm_head.weight" in self._parts:
            # torch's state_dict() and some exporters keep the tied copy: the same values, dropped.
            # A different one is not a copy, and which of the two the model means is not ours to guess.
            self._check_tied_copy()
            self._parts.pop("lm_head.weight", None)
            self._shapes.pop("lm_head.weight", None)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in MoEDecoder(self.config).state_dict().items()}
        self._order = list(expected)  # state_dict order: what the weights fingerprint hashes
        if self.config.tie_embeddings:
            expected.pop("lm_head.weight", None)
        _check_shapes(expected, self._shapes, path, self.stored_as)

    def _check_tied_copy(self, rows: int = 4096) -> None:
        """config.json ties the LM head to the embeddings: a stored lm_head.weight must equal them
        (compared a block of rows at a time, so memory stays a block's)."""
        head, embedding = self._parts["lm_head.weight"], self._parts.get("embed.weight")
        if embedding is None or head.derived or embedding.derived or \
                self._shapes["lm_head.weight"] != self._shapes.get("embed.weight"):
            return  # a shape mismatch is _check_shapes' to name
        (head_file, head_key), (emb_file, emb_key) = head.files[0], embedding.files[0]
        for start in range(0, self._shapes["lm_head.weight"][0], rows):
            block = (slice(start, start + rows),)
            if not torch.equal(_read(head_file, head_key, block), _read(emb_file, emb_key, block)):
                raise CheckpointError(
                    f"{self.path / 'config.json'} ties the LM head to the embeddings (tie_word_embeddings: true), "
                    f"but {head_file.name} holds an lm_head weight ({head_key}) that differs from them; set "
                    "tie_word_embeddings to false to use it, or delete it to tie")

    def names(self) -> list[str]:
        """Our tensor names in `MoEDecoder.state_dict()` order (a tied lm_head included)."""
        return list(self._order)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._alias(name)]

    def tensor(self, name: str) -> torch.Tensor:
        """One of our tensors, read (and stacked, for per-expert files) in the checkpoint's dtype."""
        part = self._parts[self._alias(name)]
        if part.per_expert or (part.derived is not None and part.derived.per_expert):
            return torch.stack(list(self.experts(name)))
        if part.derived is not None:
            return part.make()
        (file, key), = part.files
        index = (slice(None), slice(*part.rows)) if part.rows else None
        return _read(file, key, index)

    def experts(self, name: str) -> Iterator[torch.Tensor]:
        """A stacked (E, out, in) expert tensor one expert at a time: the unit of streaming."""
        part = self._parts[self._alias(name)]
        if part.per_expert:
            for file, key in part.files:
                yield _read(file, key)
            return
        if part.derived is not None:
            if part.derived.per_expert:
                for e in range(self.shape(name)[0]):
                    yield part.make((e,))
            else:
                yield from part.make()  # a small 3-D tensor (DeepSeek's per-head split): made whole
            return
        (file, key), = part.files
        for e in range(self.shape(name)[0]):
            yield _read(file, key, (e, slice(*part.rows)) if part.rows else (e,))

    def block(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Part of a tensor that is stored whole (rows or columns of a 2-D weight), read
        without the rest: the unit of streaming for a large embedding or LM head."""
        part = self._parts[self._alias(name)]
        if part.per_expert or part.rows or part.derived is not None:
            return self.tensor(name)[index]
        (file, key), = part.files
        return _read(file, key, index)

    def stored_as(self, name: str, expert: int | None = None) -> str:
        """Where the checkpoint keeps our tensor `name` (expert `expert` of it), in its own tensor
        and file names: what a message about it names, since the user knows those, not ours."""
        part = self._parts[self._alias(name)]
        files = part.files[expert:expert + 1] if part.per_expert and expert is not None else part.files
        where = few_names([key for _, key in files])
        if expert is not None and not part.per_expert:
            where += f", expert {expert}"
        if part.rows:
            where += f", rows {part.rows[0]} to {part.rows[1] - 1} of each expert"
        return f"{where}, in {few_names(sorted({file.name for file, _ in files}))}"

    def _alias(self, name: str) -> str:
        return "embed.weight" if name == "lm_head.weight" and self.config.tie_embeddings else name


def _read(file: Path, key: str, index: tuple | None = None) -> torch.Tensor:
    """One tensor or slice, copied out of the memory-mapped shard, which is closed again at once
    (so the pages read do not stay mapped in this process)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            if index is None:
                return f.get_tensor(key)
            return f.get_slice(key)[index].clone()
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}); re-download it") from None


#: the safetensors dtypes a weight may be stored in: transformers casts each to the model's dtype
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _read_headers(path: Path, dtypes: dict[str, str] | None = None) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor's shard and shape, from the safetensors headers alone (no data is read);
    `dtypes`, when given, gets every tensor's safetensors dtype ("F32", "I32", ...)."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
                shapes = {name: tuple(s.get_shape()) for name, s in slices.items()}
                if dtypes is not None:
                    dtypes.update({name: s.get_dtype() for name, s in slices.items()})
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}); re-download it") from None
        # without an index nothing says which copy is meant (transformers reads model.safetensors
        # alone): a tensor in two files, a stray old shard say, is refused rather than picked
        if twice := sorted(name for name in shapes if name in found):
            which = f"{twice[0]!r}" + (f" and {len(twice) - 1} more tensors are" if len(twice) > 1 else " is")
            both = f"{which} in both {found[twice[0]][0].name} and {file.name}"
            if (path / INDEX_FILE).is_file():  # both listed by the index: one of them holds a copy it should not
                named = _indexed_file(path, twice[0])
                others = [f for f in (found[twice[0]][0].name, file.name) if f != named]
                raise CheckpointError(f"{both}, which {INDEX_FILE} both lists; "
                                      + (f"it names {named} for it: remove the copy in {others[0]}" if named and others
                                         else "remove the copy that is not meant"))
            raise CheckpointError(f"{both}; remove the file that is not part of the checkpoint (or add a "
                                  f"{INDEX_FILE} naming the shards)")
        found |= {name: (file, shape) for name, shape in shapes.items()}
    return found


def _check_float_weights(parts: dict[str, _Part], dtypes: dict[str, str]) -> None:
    """Every tensor a weight is read from is stored in a float dtype, or in the dtype its
    family's derivation declares (MXFP4's uint8 codes and scales): an int32 or bool weight was
    cast to float without a word (transformers does the same), a complex one lost its imaginary
    part with a warning, and an fp8 one failed inside torch.stack as an "internal error"."""
    for part in parts.values():
        declared = part.derived.source_dtypes if part.derived is not None else None
        for i, (file, key) in enumerate(part.files):
            dtype = dtypes.get(key, "F32")
            if declared is not None:
                if dtype != declared[i]:
                    raise CheckpointError(
                        f"{key} in {file.name} is stored as {dtype}, where its format keeps {declared[i]}: re-download "
                        "that file if it is damaged, or fix the checkpoint")
            elif dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{key} in {file.name} is stored as {dtype}; weights are read as {', '.join(FLOAT_DTYPES[:-1])} "
                    f"or {FLOAT_DTYPES[-1]}: re-download that file if it is damaged, or convert the checkpoint to one "
                    "of those dtypes")


def _hf_parts(
    headers: dict[str, tuple[Path, tuple[int, ...]]], config: DecoderConfig, family: Family
) -> tuple[dict[str, _Part], dict[str, tuple[int, ...]]]:
    """Map Hugging Face tensor names onto ours: renamed, per-expert files stacked, a fused
    gate_up_proj split into its gate and up rows. Shapes come from the headers."""
    names = family.names
    parts: dict[str, _Part] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    per_expert: dict[tuple[int, str], dict[int, tuple[Path, str, tuple[int, ...]]]] = {}
    direct = [(re.compile(pattern), target) for pattern, target in names.direct]
    per_expert_re, fused_re = re.compile(names.per_expert), re.compile(names.fused_gate_up)
    unknown = []
    extra_layer = re.compile(r"model\.layers\.(\d+)\.")
    claimed: set[str] = set()
    if family.derive is not None:
        for ours, derived in family.derive({k: shape for k, (_, shape) in headers.items()}, config).items():
            for src, want in zip(derived.sources, derived.source_shapes or (), strict=False):
                if headers[src][1] != want:
                    raise CheckpointError(
                        f"{src} has shape {headers[src][1]}; config.json implies {want}: fix config.json or the weights"
                    )
            parts[ours] = _Part(tuple((headers[src][0], src) for src in derived.sources), derived=derived)
            shapes[ours] = derived.shape
            claimed.update(derived.sources)
    for name, (file, shape) in headers.items():
        if name in claimed:
            continue
        if names.skip_extra_layers and (m := extra_layer.match(name)) and int(m[1]) >= config.n_layers:
            continue
        if m := per_expert_re.fullmatch(name):
            layer, expert, w = int(m[1]), int(m[2]), m[3]
            per_expert.setdefault((layer, names.roles[w]), {})[expert] = (file, name, shape)
        elif m := fused_re.fullmatch(name):
            # (E, 2I, H), gate rows first, as transformers writes it. Shapes cannot tell it
            # from a transposed (E, H, 2I) one when H == 2I, so no other layout is guessed at:
            # anything else fails the shape check below with a clear message.
            I = config.expert_hidden  # noqa: E741
            if len(shape) != 3 or shape[1] != 2 * I:
                raise CheckpointError(
                    f"{name} has shape {shape}; expected (num_experts, "
                    f"2 * the experts' intermediate size = {2 * I}, hidden_size) as transformers writes it"
                )
            for w, rows in (("w_gate", (0, I)), ("w_up", (I, 2 * I))):
                parts[f"layers.{m[1]}.ffn.{w}"] = _Part(((file, name),), rows)
                shapes[f"layers.{m[1]}.ffn.{w}"] = (shape[0], I, shape[2])
        else:
            for pattern, target in direct:
                if pattern.fullmatch(name):
                    ours = pattern.sub(target, name)
                    parts[ours], shapes[ours] = _Part(((file, name),)), shape
                    break
            else:
                unknown.append(name)
    if unknown:
        files = sorted({headers[name][0].name for name in unknown})
        where = f" (in {_few(files)})" if len({file for file, _ in headers.values()}) > 1 else ""
        raise CheckpointError(f"unexpected tensors for a {family.title} checkpoint{where}: {_few(unknown)}")
    for (layer, w), experts in per_expert.items():
        missing = sorted(set(range(config.n_experts)) - set(experts))
        if missing or len(experts) != config.n_experts:
            raise CheckpointError(
                f"layer {layer} {w}: config.json says {family.experts_key}={config.n_experts}, but the weights "
                f"hold {len(experts)}: {_few([str(j) for j in sorted(experts)], 8)}"
                + (f" (missing {_few([str(j) for j in missing])})" if missing else "")
                + "; fix config.json or the weight files"
            )
        ours = f"layers.{layer}.ffn.{w}"
        first = experts[0][2]
        if any(shape != first for _, _, shape in experts.values()):
            implied = {"w_gate": (config.expert_hidden, config.hidden_size), "w_up": (config.expert_hidden,
                       config.hidden_size), "w_down": (config.hidden_size, config.expert_hidden)}.get(w)
            shapes_found = [shape for _, _, shape in experts.values()]
            # the shape config.json implies where an expert has it (two experts, one transposed:
            # a majority cannot tell which), else the most common one
            common = implied if implied in shapes_found else collections.Counter(shapes_found).most_common(1)[0][0]
            odd = [(name, file, shape) for _, (file, name, shape) in sorted(experts.items()) if shape != common]
            name, file, shape = odd[0]
            more = f" (and {len(odd) - 1} more of its experts)" if len(odd) > 1 else ""
            raise CheckpointError(f"{name} in {file.name} has shape {shape}, the layer's other experts {common}{more}; "
                                  "re-download that file if it is damaged, or fix the weights")
        parts[ours] = _Part(tuple((experts[j][0], experts[j][1]) for j in range(config.n_experts)), per_expert=True)
        shapes[ours] = (config.n_experts, *first)
    return parts, shapes


def _check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], path: Path,
                  stored_as: Callable[[str], str] | None = None) -> None:
    """`stored_as(name)`: the checkpoint's own names for one of ours, shown beside it."""
    def stored(k: str) -> str:
        return f"; stored as {stored_as(k)}" if stored_as is not None else ""

    missing = sorted(set(expected) - set(found))
    unexpected = [f"{k} ({stored(k).removeprefix('; ')})" if stored_as else k for k in sorted(set(found) - set(expected))]
    wrong = [
        f"{k} {found[k]} (expected {expected[k]}{stored(k)})"
        for k in sorted(set(expected) & set(found))
        if found[k] != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_few(unexpected)}")
    if wrong:
        problems.append(f"shape mismatch: {_few(wrong)}")
    if problems:
        raise CheckpointError(f"{path} does not match its config.json: " + "; ".join(problems))


def _few(names: list[str], n: int = 4) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more
