"""Training data that a target generates itself, for its drafters (`python -m flashspark train data`).

Prompts come from the prompt sets of `flashspark.data` (`prompt_set(split, kind)`): chat
instructions rendered with the target's chat template, code and prose as raw text, mixed by
`--kinds` (default two chat prompts for each code and prose one). The target continues each
in batches (its CPU dtype: bf16 for SmolLM2), greedily by default, until its end-of-sequence
token or `--max-new-tokens`, and every position keeps what the drafter trainers need:

* the token (uint16 when the vocabulary fits, as SmolLM2's 49152 does);
* the label: the target's greedy token for that position (65535 / -1 where there is none:
  the prompt, whose tokens the target did not choose);
* the target's hidden states after the drafter's feature layers (bf16, [layers, hidden]);
* the target's Top-K next-token distribution (ids, fp16 log-probs) for DSpark's TV loss.

Features are stored rather than recomputed during training: generation computes them anyway,
so storing them costs disk (5 layers x 576 x 2 bytes = 5.6 KiB per SmolLM2 token) and no
compute, whereas recomputing them would run most of a target forward over every training
sequence at every step (numbers: docs/smollm2.md).

Layout of a data directory: `shard_NNNNN/` per generated batch (`tokens.npy`, `labels.npy`,
`features.npy` (bf16 bits as int16), `topk_ids.npy`, `topk_logp.npy`, `seqs.npy`: offset,
length, prompt length, kind and prompt index of each sequence), and `progress.json`, written
after each shard: the data's definition, the shards, the prompt cursors and the generation
time so far. A shard is complete once listed there, so an interrupted run resumes exactly at
the next batch (`--resume`); `--minutes` is the budget of the whole run across sessions, and
`--max-tokens` the size at which the data is complete.

`TargetData` reads a directory through memory maps: training batches of windows with each
row's anchor range (its generated part), and padded held-out sets for evaluation.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import data
from ..models import catalog
from ..models.dflash import target_layer_ids
from ..models.io import weights_fingerprint
from . import self_instruct

NO_LABEL = -1
# The stdlib prompt kinds, then general chat that the target writes itself (`self_instruct`).
DATA_KINDS = data.PROMPT_KINDS + ("self",)
KIND_IDS = {k: i for i, k in enumerate(DATA_KINDS)}
PROGRESS = "progress.json"
# What defines the data: a resumed run must ask for the same.
DEFINING = (
    "target",
    "split",
    "kinds",
    "max_new_tokens",
    "max_prompt_tokens",
    "temperature",
    "top_k",
    "num_features",
    "batch_size",
    "seed",
)


@dataclass
class DataArgs:
    resume: bool = False
    threads: int = 2
    seed: int = 0
    command: str = ""  # the command line, kept in progress.json
    out: str = ""  # the data directory ("": `default_out` of the target and split)
    target: str = "smollm2"
    split: str = "train"
    minutes: float = 60.0  # generation time of the whole run, over every session
    max_tokens: int = 0  # stop once this many tokens are stored (0: the budget decides)
    kinds: str = "chat:2,code:1,prose:1"  # prompt kinds and their shares
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384  # longer prompts are skipped
    temperature: float = 0.0  # 0: greedy continuations (labels = tokens in the continuation)
    top_k: int = 32
    num_features: int = 5  # feature layers, by the drafters' rule (models.dflash.target_layer_ids)
    batch_size: int = 32
    max_prompts: int = 0  # per kind (0: all); small held-out and calibration sets
    # The target's dtype while generating ("": its CPU dtype, bf16 for SmolLM2). float32 where the
    # CPU has no fast bf16 matmuls (then 10-20x slower than fp32); the weights are the same, so
    # the data's target fingerprint is too.
    dtype: str = ""
    device: str = "cpu"  # the target's device while generating


def parse_kinds(text: str) -> list[tuple[str, int]]:
    """'chat:2,code:1' -> [('chat', 2), ('code', 1)]; a kind without a share gets 1."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, _, share = part.partition(":")
        if kind not in DATA_KINDS:
            raise ValueError(f"--kinds: unknown prompt kind {kind!r}; expected some of {DATA_KINDS}")
        if share and not (share.isdigit() and int(share) > 0):
            raise ValueError(f"--kinds: the share of {kind} must be a positive integer, got {share!r}")
        out.append((kind, int(share or 1)))
    if not out or len({k for k, _ in out}) != len(out):
        raise ValueError(f"--kinds must name each kind once, e.g. chat:2,code:1,prose:1; got {text!r}")
    return out


def format_kinds(kinds: list[tuple[str, int]]) -> str:
    """The canonical text of parsed kinds ('chat:2,code:1'): what a data directory records, so
    that ' chat:2, code' and 'chat:2,code:1' resume the same data."""
    return ",".join(f"{kind}:{share}" for kind, share in kinds)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.int32


# ------------------------------------------------------------------------ generation
@torch.no_grad()
def continue_batch(target, prompts: list[list[int]], max_new_tokens: int, layer_ids, stop_ids, top_k, temperature, gen):
    """Continue ragged prompts with the target (one ragged prefill, then batched decode steps).

    Returns per prompt a dict: tokens [N] (prompt + continuation, stopping after a stop token),
    labels [N] (the target's greedy token at each generated position, NO_LABEL on the prompt),
    features [N, n, D] bf16 (row N - 1, a token never fed, is zero), topk_ids / topk_logp
    [N, K] (the target's distribution at each generated position; prompt rows empty)."""
    B = len(prompts)
    lens = [len(p) for p in prompts]
    device = target.model.embed_tokens.weight.device
    tokens = torch.zeros(B, max(lens), dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    cache = target.new_cache(B, max(lens) + max_new_tokens)
    P = torch.tensor(lens, device=device)
    last, hidden = target.backbone(tokens.to(device), cache, torch.zeros_like(P), P, hidden_layers=layer_ids)
    prompt_feats = [hidden[b, : lens[b]].to("cpu", torch.bfloat16) for b in range(B)]
    logits = target.lm_head(last[torch.arange(B, device=device), P - 1]).float()
    steps_tok, steps_lab, steps_ids, steps_logp, steps_feat = [], [], [], [], []
    done = torch.zeros(B, dtype=torch.bool)
    n_gen = torch.zeros(B, dtype=torch.int64)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.int64)
    pos, ones = P.clone(), torch.ones(B, dtype=torch.int64, device=device)
    for i in range(max_new_tokens):
        logp = torch.log_softmax(logits, -1)  # on the target's device: only the Top-K comes back
        v, j = logp.topk(top_k, -1)
        v, j = v.cpu(), j.cpu()
        label = logp.argmax(-1).cpu()
        if temperature <= 0:
            nxt = label
        else:  # sampled on the CPU, with the run's CPU generator
            nxt = torch.multinomial((logp.cpu() / temperature).softmax(-1), 1, generator=gen)[:, 0]
        steps_tok.append(nxt)
        steps_lab.append(label)
        steps_ids.append(j)
        steps_logp.append(v.to(torch.float16))
        n_gen += (~done).long()
        done |= torch.isin(nxt, stop)
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        last, hidden = target.backbone(nxt[:, None].to(device), cache, pos, ones, hidden_layers=layer_ids)
        steps_feat.append(hidden[:, 0].to("cpu", torch.bfloat16))
        logits = target.lm_head(last[:, 0]).float()
        pos += 1
    tok_s, lab_s = torch.stack(steps_tok, 1), torch.stack(steps_lab, 1)
    ids_s, logp_s = torch.stack(steps_ids, 1), torch.stack(steps_logp, 1)
    feat_s = torch.stack(steps_feat, 1) if steps_feat else prompt_feats[0].new_zeros(B, 0, *hidden.shape[2:])
    out = []
    for b in range(B):
        g, p = int(n_gen[b]), lens[b]
        n = p + g
        feats = torch.zeros((n,) + tuple(feat_s.shape[2:]), dtype=torch.bfloat16)
        feats[:p] = prompt_feats[b]
        feats[p : n - 1] = feat_s[b, : g - 1]
        ids = torch.zeros(n, top_k, dtype=torch.int64)
        logp = torch.full((n, top_k), float("-inf"), dtype=torch.float16)
        ids[p:], logp[p:] = ids_s[b, :g], logp_s[b, :g]
        out.append(
            {
                "tokens": torch.cat([torch.tensor(prompts[b]), tok_s[b, :g]]),
                "labels": torch.cat([torch.full((p,), NO_LABEL), lab_s[b, :g]]),
                "features": feats,
                "topk_ids": ids,
                "topk_logp": logp,
            }
        )
    return out


def stop_token_ids(target, tok) -> set[int]:
    """Where a continuation stops: the target's EOS and the tokenizer's <|endoftext|>, those that exist."""
    return {i for i in (catalog.eos_token_id(target, tok), tok.token_to_id(data.EOT_TOKEN)) if i is not None}


def render_taken(taken, target, tok, chat, stop_ids, seed: int, offset: int) -> list[str | None]:
    """The prompt texts of `PromptStream.take`'s prompts: self-instruct seeds become the requests
    the target writes (sampled with a generator seeded by the shard and the batch position, so a
    resumed run writes the same ones; None where it wrote none), the others are rendered."""
    seeds = [p for kind, _, p in taken if kind == "self"]
    if seeds:
        gen = torch.Generator().manual_seed(seed * 7919 + offset + 1)
        requests = iter(self_instruct.write_requests(target, tok, chat, seeds, stop_ids, gen, continue_batch))
    out = []
    for kind, _, p in taken:
        if kind != "self":
            out.append(data.render_prompt(p, chat))
        else:
            r = next(requests)
            out.append(None if r is None else chat([{"role": "user", "content": r}]))
    return out


class PromptStream:
    """The prompts of a split in a fixed order: kinds interleaved by their shares, each kind in
    `prompt_set`'s order; `cursors` (per kind) and `turn` (the position in the interleaving)
    say where it stands, so a resumed run continues with the next prompt."""

    def __init__(self, split: str, kinds: list[tuple[str, int]], max_prompts: int, cursors=None, turn=0):
        self.pattern = [k for k, share in kinds for _ in range(share)]
        self.sets = {k: self_instruct.seed_set(split) if k == "self" else data.prompt_set(split, k) for k, _ in kinds}
        if max_prompts:
            self.sets = {k: v[:max_prompts] for k, v in self.sets.items()}
        self.cursors = dict(cursors or {k: 0 for k, _ in kinds})
        self.turn = turn

    def take(self, n: int) -> list[tuple[str, int, data.Prompt]]:
        out = []
        while len(out) < n and any(self.cursors[k] < len(self.sets[k]) for k in self.sets):
            kind = self.pattern[self.turn % len(self.pattern)]
            self.turn += 1
            if self.cursors[kind] < len(self.sets[kind]):
                out.append((kind, self.cursors[kind], self.sets[kind][self.cursors[kind]]))
                self.cursors[kind] += 1
        return out


def _definition(a: DataArgs, kinds, target, layer_ids) -> dict:
    d = {k: getattr(a, k) for k in DEFINING}
    c = target.config
    return d | {
        "kinds": format_kinds(kinds),
        "layer_ids": layer_ids,
        "target_config": {k: getattr(c, k) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers")},
        "target_weights": weights_fingerprint(target),
        "max_prompts": a.max_prompts,
    }


def _save_shard(directory: Path, rows: list[dict], meta: list[tuple[int, int, int]], vocab: int) -> int:
    """Write one shard atomically (a temporary directory renamed); returns its token count."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tdt = token_dtype(vocab)
    lengths = [len(r["tokens"]) for r in rows]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    seqs = np.array([[o, n, p, k, i] for o, n, (p, k, i) in zip(offsets, lengths, meta)], dtype=np.int64)

    def cat(key):
        return torch.cat([r[key] for r in rows])

    labels = cat("labels").numpy()
    np.save(tmp / "tokens.npy", cat("tokens").numpy().astype(tdt))
    np.save(tmp / "labels.npy", np.where(labels < 0, np.iinfo(tdt).max, labels).astype(tdt))
    np.save(tmp / "features.npy", cat("features").view(torch.int16).numpy())
    np.save(tmp / "topk_ids.npy", cat("topk_ids").numpy().astype(tdt))
    np.save(tmp / "topk_logp.npy", cat("topk_logp").numpy())
    np.save(tmp / "seqs.npy", seqs)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return int(sum(lengths))


@contextlib.contextmanager
def writer_lock(directory: Path):
    """One writer per data directory: two runs appending to it would interleave their shards
    and cursors. An advisory lock on `.lock`, which the kernel drops when its holder dies (no
    stale lock to clear, no pid to be reused); the file keeps the holder's pid for the message."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            raise ValueError(f"{directory} is being written by process {holder}: wait for it or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def default_out(target: str, split: str) -> str:
    """Where a known target's data of a split lives: runs/<target>/data, or data_<split> for
    the held-out and calibration splits. A target given by path needs its --out."""
    known = catalog.resolve_target(target).known
    if known is None:
        raise ValueError("--out must be given for a target given by path")
    return f"runs/{known.name}/data" + ("" if split == "train" else f"_{split}")


def generate_data(a: DataArgs) -> dict:
    """Generate (or continue generating) a data directory; returns its progress record."""
    kinds = parse_kinds(a.kinds)
    out = Path(a.out or default_out(a.target, a.split))
    if (out / PROGRESS).is_file() and not a.resume:
        raise ValueError(f"{out} already holds generated data: pass --resume to continue it, or another --out")
    if a.resume and not (out / PROGRESS).is_file():
        raise FileNotFoundError(f"--resume given but no {out / PROGRESS}")
    with writer_lock(out):
        return _generate(a, kinds, out)


def _generate(a: DataArgs, kinds, out: Path) -> dict:
    torch.set_num_threads(a.threads)
    progress_path = out / PROGRESS
    ref = catalog.resolve_target(a.target)
    tok = catalog.target_tokenizer(ref)
    chat = catalog.target_chat_template(ref)
    if {"chat", "self"} & set(dict(kinds)) and chat is None:
        raise ValueError(f"the target {ref.label} has no chat template: leave chat and self out of --kinds")
    target = catalog.load_target(ref, dtype=getattr(torch, a.dtype) if a.dtype else None, device=a.device)
    layer_ids = target_layer_ids(target.config.num_hidden_layers, a.num_features)
    definition = _definition(a, kinds, target, layer_ids)
    if a.resume:
        progress = json.loads(progress_path.read_text())
        stored = progress["definition"]
        stored["kinds"] = format_kinds(parse_kinds(stored["kinds"]))  # recorded as typed before it was canonical
        if "target_weights" not in stored:
            # Written before weight fingerprints: which weights made its shards is unknown, so it stays
            # unrecorded (check_for then checks the shape only) rather than vouching for this target.
            definition.pop("target_weights")
        if stored != definition:
            diff = sorted(k for k in definition if stored.get(k) != definition[k])
            raise ValueError(f"{out} was generated with other settings ({', '.join(diff)}); use another --out")
    else:
        progress = {
            "definition": definition,
            "shards": [],
            "cursors": None,
            "turn": 0,
            "sequences": 0,
            "tokens": 0,
            "generated_tokens": 0,
            "skipped_prompts": 0,
            "seconds": 0.0,
            "complete": False,  # every prompt of the split used
            "commands": [],
        }
    progress.setdefault("commands", []).append(a.command)
    stream = PromptStream(a.split, kinds, a.max_prompts, progress["cursors"], progress["turn"])
    stop_ids = stop_token_ids(target, tok)
    budget = a.minutes * 60.0
    bar = tqdm(total=round(budget), initial=min(round(progress["seconds"]), round(budget)), unit="s", desc="generate")
    bar.set_postfix(tokens=progress["tokens"], refresh=False)
    vocab = target.config.vocab_size
    while progress["seconds"] < budget and not progress["complete"]:
        if a.max_tokens and progress["tokens"] >= a.max_tokens:
            break  # large enough for now; a later run may ask for more
        t0 = time.time()
        batch, meta, skipped = [], [], 0
        while len(batch) < a.batch_size:
            taken = stream.take(a.batch_size - len(batch))
            if not taken:
                break
            shard = len(progress["shards"])
            texts = render_taken(taken, target, tok, chat, stop_ids, a.seed * 1_000_003 + shard, len(batch))
            for (kind, index, _), text in zip(taken, texts):
                ids = tok.encode(text, add_special_tokens=False).ids if text is not None else []
                if not ids or len(ids) > a.max_prompt_tokens:
                    skipped += 1
                    continue
                batch.append(ids)
                meta.append((len(ids), KIND_IDS[kind], index))
        if not batch:
            progress["complete"] = True
            break
        shard = len(progress["shards"])
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + shard)
        rows = continue_batch(target, batch, a.max_new_tokens, layer_ids, stop_ids, a.top_k, a.temperature, gen)
        name = f"shard_{shard:05d}"
        n_tokens = _save_shard(out / name, rows, meta, vocab)
        progress["shards"].append(name)
        progress["cursors"], progress["turn"] = dict(stream.cursors), stream.turn
        progress["sequences"] += len(rows)
        progress["tokens"] += n_tokens
        progress["generated_tokens"] += sum(len(r["tokens"]) for r in rows) - sum(m[0] for m in meta)
        progress["skipped_prompts"] += skipped
        progress["seconds"] += time.time() - t0
        data.write_json(progress_path, progress)
        bar.update(max(0, min(round(progress["seconds"]), bar.total) - bar.n))
        rate = progress["generated_tokens"] / max(progress["seconds"], 1e-9)
        bar.set_postfix(sequences=progress["sequences"], tokens=progress["tokens"], gen_tok_s=f"{rate:.0f}")
    bar.close()
    data.write_json(progress_path, progress)
    return progress


# ------------------------------------------------------------------------ reading
class TargetData:
    """A generated data directory, memory-mapped: `sequences` of ragged length, and what a
    drafter trainer draws from them."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        path = self.dir / PROGRESS
        if not path.is_file():
            raise FileNotFoundError(f"{self.dir} holds no generated target data ({PROGRESS})")
        self.progress = json.loads(path.read_text())
        self.definition = self.progress["definition"]
        self.layer_ids = self.definition["layer_ids"]
        self.shards = []
        index = []
        for s, name in enumerate(self.progress["shards"]):
            d = self.dir / name
            arrays = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("tokens", "labels", "features", "topk_ids")}
            arrays["topk_logp"] = np.load(d / "topk_logp.npy", mmap_mode="r")
            seqs = np.load(d / "seqs.npy")
            self.shards.append(arrays)
            index.append(np.concatenate([np.full((len(seqs), 1), s), seqs[:, :3]], 1))
        if not index:
            raise ValueError(f"{self.dir} holds no finished shard yet")
        self.index = np.concatenate(index)  # [n, 4]: shard, offset, length, prompt length
        self.no_label = int(np.iinfo(self.shards[0]["labels"].dtype).max)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> int:
        return int(self.index[:, 2].sum())

    def facts(self) -> dict:
        """What a model card says about the data."""
        p, d = self.progress, self.definition
        return {
            "dir": str(self.dir),
            "sequences": len(self),
            "tokens": self.tokens,
            "generated_tokens": p["generated_tokens"],
            "generation_minutes": p["seconds"] / 60,
            "kinds": d["kinds"],
            "split": d["split"],
            "max_new_tokens": d["max_new_tokens"],
            "temperature": d["temperature"],
        }

    def check_for(self, target, layer_ids) -> None:
        """The data must come from this very target (its shape and its weights' fingerprint)
        and hold the drafter's feature layers."""
        c, want = target.config, self.definition["target_config"]
        got = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers}
        if any(want[k] != v for k, v in got.items()):
            raise ValueError(f"{self.dir} was generated by another target ({want}); this one is {got}")
        recorded = self.definition.get("target_weights")  # absent in directories written before it
        if recorded is not None and recorded != (this := weights_fingerprint(target)):
            raise ValueError(
                f"{self.dir} was generated by a target of the same shape but other weights "
                f"(fingerprint {recorded}, this one {this}): regenerate it for this target"
            )
        if list(layer_ids) != list(self.layer_ids):
            raise ValueError(f"{self.dir} holds features of layers {self.layer_ids}; the drafter reads {layer_ids}")

    def usable(self, block_size: int) -> np.ndarray:
        """Sequences with at least one anchor: block_size generated tokens after the first."""
        return np.nonzero(self.index[:, 2] - self.index[:, 3] >= block_size + 1)[0]

    def rows(self, seqs, window: int) -> dict:
        """Sequences `seqs` as right-padded rows of at most `window` tokens (a longer one keeps
        its last `window`): tokens, labels [B, W] int64 (-1: none), features [B, W - 1, n, D]
        bf16, topk ids / logp [B, W, K], and per row `start` (the first generated token's
        index), `length` and `cut` (tokens dropped from its start)."""
        parts = []
        for i in seqs:
            s, off, n, p = (int(x) for x in self.index[i])
            cut = max(0, n - window)
            if p - cut < 1:  # the window would start inside the continuation: no context left
                raise ValueError(
                    f"a window of {window} tokens is shorter than {self.dir}'s continuations "
                    f"({n - p} tokens): pass --window greater than {n - p}"
                )
            parts.append((self.shards[s], off + cut, n - cut, p - cut))
        W = max(n for _, _, n, _ in parts)
        B = len(parts)
        sh = self.shards[0]
        feats = torch.zeros((B, W - 1) + sh["features"].shape[1:], dtype=torch.bfloat16)
        tokens = torch.zeros(B, W, dtype=torch.int64)
        labels = torch.full((B, W), NO_LABEL, dtype=torch.int64)
        ids = torch.zeros((B, W) + sh["topk_ids"].shape[1:], dtype=torch.int64)
        logp = torch.full((B, W) + sh["topk_logp"].shape[1:], float("-inf"), dtype=torch.float16)
        for b, (arr, off, n, _) in enumerate(parts):
            sl = slice(off, off + n)
            tokens[b, :n] = torch.from_numpy(arr["tokens"][sl].astype(np.int64))
            lab = arr["labels"][sl].astype(np.int64)
            labels[b, :n] = torch.from_numpy(np.where(lab == self.no_label, NO_LABEL, lab))
            feats[b, : n - 1] = torch.from_numpy(np.array(arr["features"][off : off + n - 1])).view(torch.bfloat16)
            ids[b, :n] = torch.from_numpy(arr["topk_ids"][sl].astype(np.int64))
            logp[b, :n] = torch.from_numpy(np.array(arr["topk_logp"][sl]))
        return {
            "tokens": tokens,
            "labels": labels,
            "features": feats,
            "topk_ids": ids,
            "topk_logp": logp,
            "start": torch.tensor([p for _, _, _, p in parts]),
            "length": torch.tensor([n for _, _, n, _ in parts]),
            # Tokens each row lost to the window: its features saw them, a target run on the row would not.
            "cut": torch.tensor([off - int(self.index[i][1]) for i, (_, off, _, _) in zip(seqs, parts)]),
        }

    def eval_set(self, block_size: int, window: int, limit: int | None = None, anchors_per_row: int = 48) -> dict:
        """Every usable sequence (the first `limit`) as padded rows for the held-out evaluations,
        with `anchors_per_row` anchors of each row spread evenly over its continuation
        (`anchors` [B, A]: from its first generated token to the last whose block fits) and
        which of them count (`valid`: a short continuation repeats anchors, counted once). A
        few dozen per row measure what every position would, at a fraction of the cost: the
        LM head over 49152 tokens dominates an evaluation."""
        seqs = self.usable(block_size)[:limit]
        if len(seqs) == 0:
            raise ValueError(
                f"{self.dir} has no sequence with a block of {block_size} in its continuation"
                + ("" if limit is None else f" among its first {limit}")
            )
        ev = self.rows(seqs, window)
        ev["labels"] = ev["labels"].clamp(min=0)  # rows' padding: read by no anchor
        span = ev["length"] - block_size - ev["start"]  # the last anchor's offset
        steps = torch.linspace(0, 1, anchors_per_row)
        ev["anchors"] = ev["start"][:, None] + (steps[None] * span[:, None]).round().long()
        ev["valid"] = torch.ones_like(ev["anchors"], dtype=torch.bool)
        ev["valid"][:, 1:] = ev["anchors"][:, 1:] != ev["anchors"][:, :-1]
        return ev


def sample_row_anchors(start: torch.Tensor, length: torch.Tensor, blocks: int, block_size: int, gen) -> torch.Tensor:
    """[B, blocks] anchors uniform in each row's [start, length - block_size]."""
    span = (length - block_size - start + 1).clamp(min=1)
    u = torch.rand(len(start), blocks, generator=gen)
    return start[:, None] + (u * span[:, None]).long().clamp(max=span[:, None] - 1)
