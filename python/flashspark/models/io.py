"""Load and save targets: Hugging Face style directories (`config.json` plus
`model.safetensors`, or shards listed in `model.safetensors.index.json`) and
GGUF files (`models.gguf`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from .. import data
from .config import DecoderConfig
from .decoder import DecoderForCausalLM

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Index metadata: the files of another checkpoint this one reads tensors from, with their sha256.
SHARED_KEY = "shared_files"


def hf_parameter_names(config: DecoderConfig) -> list[str]:
    """The tensor names a Hugging Face checkpoint of this family and shape holds."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, bias in (("q_proj", config.qkv_bias), ("k_proj", config.qkv_bias), ("v_proj", config.qkv_bias)):
            names += [p + f"self_attn.{proj}.weight"] + ([p + f"self_attn.{proj}.bias"] if bias else [])
        names += [p + "self_attn.o_proj.weight"] + ([p + "self_attn.o_proj.bias"] if config.o_bias else [])
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names += [p + f"mlp.{proj}.weight"] + ([p + f"mlp.{proj}.bias"] if config.mlp_bias else [])
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            meta = json.loads(index.read_text())
            weight_map = meta["weight_map"]
            shared = meta.get("metadata", {}).get(SHARED_KEY, {})
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        names = sorted(set(weight_map.values()))
        for f in names:
            # A file outside the directory is read only when the index names it with the hash it
            # was written against: a retrained or edited backbone is refused, not silently mixed in.
            if Path(f).name != f and f not in shared:
                raise ValueError(f"{index} maps tensors to {f}, outside the directory, without its sha256")
        files = [path / f for f in names]
    elif (path / WEIGHTS_NAME).is_file():
        files, shared = [path / WEIGHTS_NAME], {}
    else:
        files, shared = sorted(path.glob("*.safetensors")), {}
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f} listed in {INDEX_NAME} is missing")
    for name, digest in shared.items():
        if _sha256(path / name) != digest:
            raise ValueError(
                f"{path} shares the tensors of {path / name}, which changed since it was written: "
                f"export both again (the shared file's sha256 is not {digest[:12]}...)"
            )
    return files


def has_weights(path: str | Path) -> bool:
    """Whether a checkpoint directory holds weights: model.safetensors, or a shard index."""
    path = Path(path)
    return (path / WEIGHTS_NAME).is_file() or (path / INDEX_NAME).is_file()


def load_state_dict(path: str | Path, files: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (every shard); `files`, when given, gets each
    tensor's file."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            shard = load_file(str(f))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read weights file {f}: {e}") from None
        tensors.update(shard)
        if files is not None:
            files.update(dict.fromkeys(shard, f))
    return tensors


def save_weights(
    state: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int = 0, share_with: str | Path | None = None
) -> list[str]:
    """Write `state` into `path` as model.safetensors, or, when it is larger than
    `max_shard_bytes` (> 0), as shards `model-0000i-of-0000n.safetensors` of at most that size
    (a tensor larger than it gets a shard of its own) listed in model.safetensors.index.json, as
    Hugging Face checkpoints are. Weight files of an earlier save are removed first, so the
    directory never mixes two. Returns the file names written.

    `share_with`: another checkpoint directory (a frozen backbone's). Tensors equal to its own
    (name, dtype, shape and values) are not written again: the index maps them to its files by
    relative path, with each such file's sha256, and loading checks it. `export_drafter` writes
    the self-contained copy an engine loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    reused: dict[str, str] = {}
    if share_with is not None:
        share_with = Path(share_with)
        if share_with.resolve() == path.resolve():
            raise ValueError(f"{path} cannot share the tensors of its own directory")
        where: dict[str, Path] = {}
        theirs = load_state_dict(share_with, where)
        for n, t in state.items():
            other = theirs.get(n)
            if other is not None and other.dtype == t.dtype and other.shape == t.shape and torch.equal(other, t):
                reused[n] = os.path.relpath(where[n], path)
    for old in [*path.glob("*.safetensors"), path / INDEX_NAME]:
        old.unlink(missing_ok=True)
    own = {n: t for n, t in state.items() if n not in reused}
    size = {n: t.numel() * t.element_size() for n, t in state.items()}
    own_bytes = sum(size[n] for n in own)
    if not reused and (max_shard_bytes <= 0 or own_bytes <= max_shard_bytes):
        save_file(own, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    # The safetensors header (names, shapes, offsets) counts too: keep 64 KiB for it.
    budget = max(1, max_shard_bytes - 65536) if max_shard_bytes > 0 else own_bytes + 1
    shards: list[list[str]] = [[]]
    used = 0
    for n in own:
        if shards[-1] and used + size[n] > budget:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += size[n]
    shards = [keys for keys in shards if keys]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: own[k] for k in keys}, str(path / name), metadata={"format": "pt"})
    metadata: dict = {"total_size": sum(size.values())}
    if reused:
        metadata[SHARED_KEY] = {f: _sha256(path / f) for f in sorted(set(reused.values()))}
    index = {
        "metadata": metadata,
        "weight_map": {k: name for name, keys in zip(names, shards) for k in keys} | reused,
    }
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def is_self_contained(path: str | Path) -> bool:
    """Whether every weight file of a checkpoint directory lies inside it."""
    return all(f.parent == Path(path) for f in _weight_files(Path(path)))


def export_drafter(src: str | Path, dst: str | Path, max_shard_bytes: int = 0) -> list[str]:
    """Copy a checkpoint directory into `dst` with every tensor in its own files (those a
    shipped drafter reads from its backbone's directory included), in shards of at most
    `max_shard_bytes`: the directory an engine, or the method's reference code, loads."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"drafter directory {src} not found")
    if dst.resolve() == src.resolve():
        raise ValueError("export into a directory other than the source")
    state = load_state_dict(src)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX_NAME:
            (dst / f.name).write_bytes(f.read_bytes())
    return save_weights(state, dst, max_shard_bytes)


SHIPPED_TARGET = Path(__file__).resolve().parent.parent / "assets" / "target"


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def load_model(
    path: str | Path | None = None, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> DecoderForCausalLM:
    """Build the target from a checkpoint directory or a `.gguf` file (default: the shipped
    target). `dtype` defaults to the config's `torch_dtype` (float32 for a GGUF, whose
    dequantized weights fp32 holds exactly).

    Raises FileNotFoundError for a missing directory/file/config/weights and ValueError for
    an unsupported architecture or feature, missing tensors, or shapes that disagree with the
    config. Extra tensors (e.g. a redundant `lm_head.weight` in a tied checkpoint) are ignored.
    """
    path = Path(path) if path is not None else SHIPPED_TARGET
    if is_gguf(path):
        from . import gguf  # GGUF files only: the gguf package is an optional, 0.2 s import

        config, tensors = gguf.read_gguf(path)
        return build_model(config, tensors, path, dtype or torch.float32, device)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} not found")
    config = DecoderConfig.from_file(path)
    return build_model(config, load_state_dict(path), path, dtype or config.dtype, device)


def build_model(
    config: DecoderConfig,
    tensors: dict[str, torch.Tensor],
    source: Path,
    dtype: torch.dtype,
    device: str | torch.device | None = None,
) -> DecoderForCausalLM:
    """The model of `config` holding `tensors` (Hugging Face names), checked against the config."""
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    expected = hf_parameter_names(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {source} is missing tensors: {', '.join(missing[:5])}{more}")
    params = dict(model.named_parameters())
    for name in expected:
        want, got = tuple(params[name].shape), tuple(tensors[name].shape)
        if want != got:
            raise ValueError(f"tensor {name} has shape {got} but the config of {source} implies {want}")
    state = {n: tensors[n].to(dtype) for n in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    # The file it came from: which drafters fit it (models.catalog.target_of).
    model.source = Path(source)
    return model.to(device) if device is not None else model


def save_model(model: DecoderForCausalLM, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors with the family's HF tensor names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = hf_parameter_names(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {n: params[n].detach().to("cpu", dtype).contiguous() for n in names}
    config = DecoderConfig.from_dict({**model.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")})
    config.save(path / "config.json")
    save_weights(state, path)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer that goes with a model path: built from a GGUF's metadata, or a
    directory's (or file's) tokenizer.json; default: the shipped tokenizer."""
    if path is not None and is_gguf(path):
        from . import gguf  # GGUF files only: the gguf package is an optional, 0.2 s import

        return gguf.read_tokenizer(path).tokenizer
    return data.load_tokenizer(path)


FINGERPRINT_SAMPLES = 4096  # values read per tensor: enough to tell two trainings apart, cheap on 135 M


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of a model's weights, the same for its fp32 and bf16 loads: every tensor's
    name and shape, and evenly spaced samples of its values rounded to bf16 (a retrained or
    other checkpoint of the same shape differs; an fp16 load, which rounds differently and
    can overflow, need not agree). Data generated by one target records it, so a drafter is
    never trained on another target's features."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().reshape(-1)
        # Spaced by numel / samples, rounded down: a spacing that is a multiple of the row length
        # would sample one column of a [V, D] embedding only.
        # In integers: an fp32 linspace rounds its last point past the end of a 28 M-value tensor.
        n = min(flat.numel(), FINGERPRINT_SAMPLES)
        at = torch.arange(n, dtype=torch.int64, device=flat.device) * (flat.numel() - 1) // max(n - 1, 1)
        sample = flat[at].to(torch.bfloat16).float().cpu()
        h.update(f"{name}:{tuple(t.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]
