"""Speculative methods by name: which drafter, which scheduler, which path.

One place for what the CLI and the benchmarks both need:

    dflash                          DFlash, fixed K = γ - 1
    dflash:k=3                      DFlash, fixed K = 3
    dflash2:path=sample             DFlash 2, sampled paths (sparse q)
    dflash2:sched=confidence        DFlash 2 + confidence proxy + DSpark's scheduler
    dspark:sched=confidence,delay=2 DSpark with its own head, confidences two steps old
    dspark:sched=confidence,admit=budget  the engines' admission: a stale budget, then the top slots
    dflash2:tree=32                 DFlash 2, a token tree of 32 nodes per step (DFlash too; not DSpark)
    dflash2:tree=32,sched=confidence  ... the confidence scheduler cutting each tree by node survival

`Decoder(spec, target)` (or `make_decoder`) decodes with a method:
decoder(prompts, max_new_tokens, temperature, seed) -> (outputs, stats). Confidence schedulers get the SPS
table of the running machine (`profile_sps`, cached on disk), with the rest
of a step's measured time (drafting, verify, commit) added, so that
Θ = τ · SPS(T) prices whole steps.
"""

from __future__ import annotations

import json
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import data
from .decoding.loop import PATH_MODES, speculative_generate
from .decoding.plain import generate
from .models import catalog
from .models.dflash import DFlashConfig, load_dflash
from .models.dflash2 import load_dflash2
from .models.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from .models.dspark import load_dspark
from .models.io import has_weights
from .models.tree import SEARCHES
from .scheduling.confidence import ADMISSIONS, ConfidenceScheduler, ConfidenceStats, conditional
from .scheduling.costs import SPSTable, profile_sps
from .scheduling.fixed import FixedK
from .scheduling.proxy import ConfidenceProxy
from .scheduling.verdict import BatchVerdict

# The drafter registry: a new drafter is its model file plus one line here.
LOADERS = {"dflash": load_dflash, "dflash2": load_dflash2, "dspark": load_dspark}
DRAFTERS = tuple(LOADERS)
# The class config.json's `architectures` names, in each method's published format.
ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", DSPARK_ARCHITECTURE: "dspark"}


def method_of_drafter(path: str | Path) -> str:
    """The method of a drafter directory, read from its config.json's `architectures`."""
    config, d = DFlashConfig.read_json(path)
    names = d.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"{config}: architectures {names!r} names no drafter flashspark runs (known: {', '.join(ARCHITECTURES)})"
    )


SCHEDULERS = ("fixed", "confidence")
PRICES = ("padded", "packed")
PROXY_FILES = {0: "proxy_t0.json", 1: "proxy_t1.json"}  # fitted at temperature 0 and 1
PRIOR_FILE = "scheduler_prior.json"  # `python -m flashspark fit-prior`: confidence stats per temperature
# Confidence rows (request-steps) that must back the mean before a decoder's scheduler runs plain
# steps (ConfidenceScheduler.min_rows) or decodes a whole batch plainly.
MIN_PRIOR_ROWS = 64
# Weight, in rows, of the shipped prior: enough to judge a first batch, little enough that a
# batch or two of other text (and its verify outcomes) moves the estimate.
SHIPPED_PRIOR_ROWS = 256


@dataclass(frozen=True)
class MethodSpec:
    drafter: str
    k: int | None = None  # fixed K (default γ - 1), or the confidence scheduler's bound
    scheduler: str = "fixed"
    path: str = "auto"  # DFlash 2 path mode (auto: greedy at T = 0, the reference's; sample at T > 0)
    delay: int = 0  # confidence scheduler: use confidences this many steps old
    online: bool = True  # confidence proxy: update from each step's outcomes
    plain_steps: bool = True  # confidence scheduler: run plain decode steps when drafting would not pay
    admission: str = "stop"  # confidence scheduler: Algorithm 1's early stop, or "budget" (the engines' rule)
    # confidence scheduler: T of Θ = τ · SPS(T) as the loop's verify forward runs it: "padded" (every
    # row as wide as the widest request: the batch's width is chosen) or "packed" (T = Σ (k + 1), as
    # engines pack a ragged batch: Algorithm 1's slots, each one token)
    price: str = "padded"
    tree: int = 0  # > 0: a token tree of this many nodes per step (the anchor and tree - 1 drafts); 0: chains
    search: str = "best-first"  # how trees are built (models.tree.SEARCHES): best-first, or beam

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}; expected one of {DRAFTERS}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; expected one of {SCHEDULERS}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"unknown admission {self.admission!r}; expected one of {ADMISSIONS}")
        if self.price not in PRICES:
            raise ValueError(f"unknown price {self.price!r}; expected one of {PRICES}")
        if self.path not in PATH_MODES:
            raise ValueError(f"unknown path mode {self.path!r}; expected one of {PATH_MODES}")
        if self.scheduler == "confidence" and self.drafter == "dflash":
            raise ValueError("the confidence scheduler needs confidences: use dspark, or dflash2 with its proxy")
        if (self.k is not None and self.k < 0) or self.delay < 0:
            raise ValueError("k and delay must be >= 0")
        if self.tree == 1 or self.tree < 0:
            raise ValueError(f"tree must be a node budget >= 2 (or 0: chains), got {self.tree}")
        if self.tree and self.drafter == "dspark":
            raise ValueError("DSpark drafts chains only (README, Trees): trees are for dflash and dflash2")
        if self.search not in SEARCHES:
            raise ValueError(f"unknown tree search {self.search!r}; expected one of {SEARCHES}")
        if self.tree and self.k is not None:
            raise ValueError("k bounds a chain; a tree's bound is its node budget (tree=N)")


def parse_method(text: str) -> MethodSpec:
    """`name[:key=value,...]` with keys k, sched, path, delay, admit, price, online (0/1), plain (0/1), tree, search."""
    name, _, opts = text.partition(":")
    kw: dict = {}
    for opt in filter(None, opts.split(",")):
        key, _, val = opt.partition("=")
        if key == "k" and val.isdigit():
            kw["k"] = int(val)
        elif key == "delay" and val.isdigit():
            kw["delay"] = int(val)
        elif key == "tree" and val.isdigit():
            kw["tree"] = int(val)
        elif key == "search" and val:
            kw["search"] = val
        elif key == "sched" and val:
            kw["scheduler"] = val
        elif key == "path" and val:
            kw["path"] = val
        elif key == "admit" and val:
            kw["admission"] = val
        elif key == "price" and val:
            kw["price"] = val
        elif key == "online" and val in ("0", "1"):
            kw["online"] = val == "1"
        elif key == "plain" and val in ("0", "1"):
            kw["plain_steps"] = val == "1"
        else:
            raise ValueError(
                f"method option {opt!r} of {text!r} not understood "
                "(keys: k=N, sched=fixed|confidence, path=auto|backtrack|greedy|sample, delay=N, "
                "admit=stop|budget, price=padded|packed, online=0|1, plain=0|1, tree=N, search=best-first|beam)"
            )
    return MethodSpec(name, **kw)


def with_tree(method: str, nodes: int) -> str:
    """`method` verifying token trees of `nodes` nodes (a benchmark's `--tree N`): a DFlash or
    DFlash 2 spec gains (or has replaced) its tree option; plain decoding (`ar`) and DSpark,
    which drafts chains only, are returned as they are, as is every method for `nodes` 0."""
    if not nodes or method == "ar" or parse_method(method).drafter == "dspark":
        return method
    name, _, opts = method.partition(":")
    kept = [o for o in opts.split(",") if o and not o.startswith("tree=")]
    return f"{name}:{','.join(kept + [f'tree={nodes}'])}"


def drafter_dir_of(name: str, path: str | Path | None = None, target=None) -> Path:
    """Where a method's drafter lives (with its proxy and scheduler prior): `path`, else the one
    shipped for `target` (a loaded model: `models.catalog.drafter_dir`, which knows no drafter
    for a target it does not know); without a target, the tiny shipped target's."""
    if path:
        return Path(path)
    return catalog.drafter_dir(name, target) if target is not None else data.ASSETS_DIR / name


def load_method_drafter(name: str, target, path: str | Path | None = None, use_ops: bool = True):
    """The drafter of a method for `target`, from `drafter_dir_of(name, path, target)`."""
    path = drafter_dir_of(name, path, target)
    if not has_weights(path):
        known = catalog.target_of(target)
        whose = f" for {known.name}" if known else ""
        raise FileNotFoundError(
            f"no {name} drafter{whose} at {path}: train it with `{catalog.train_hint(name, known)}`"
        )
    drafter = LOADERS[name](path, target, use_ops=use_ops)
    drafter.head_dtype = drafter_head_dtype(target)
    return drafter


def drafter_head_dtype(target) -> torch.dtype | None:
    """The dtype of the drafter's LM head at inference: bf16 where the target runs fp32 on a CPU
    whose bf16 matmuls pay (`catalog.cpu_bf16_pays`; the head is the drafter's largest matmul;
    in the loop its draft time fell 15% at 8 requests, τ unchanged to 0.3%), else the target's
    own dtype (None)."""
    w = target.lm_head.weight
    if w.device.type == "cpu" and w.dtype == torch.float32 and catalog.cpu_bf16_pays():
        return torch.bfloat16
    return None


def load_proxy(drafter_dir: str | Path, temperature: float, device=None) -> ConfidenceProxy:
    """The confidence proxy saved with a DFlash 2 drafter, fitted at the temperature nearest `temperature`."""
    key = min(PROXY_FILES, key=lambda t: abs(t - temperature))
    return ConfidenceProxy.load(Path(drafter_dir) / PROXY_FILES[key], device=device)


def load_prior(drafter_dir: str | Path, temperature: float, width: int | None = None) -> ConfidenceStats | None:
    """The scheduler prior shipped with a drafter (measured in the loop on the calibration
    prompts at the temperature nearest `temperature`), weighted as SHIPPED_PRIOR_ROWS rows;
    None if the drafter has none, or (with a warning) if it covers another number of drafts
    per block than `width` (a prior left from a drafter retrained in another slot layout)."""
    path = Path(drafter_dir) / PRIOR_FILE
    if not path.is_file():
        return None
    per_t = json.loads(path.read_text())["temperatures"]
    key = min(per_t, key=lambda t: abs(float(t) - temperature))
    stats = ConfidenceStats.from_dict(per_t[key]["stats"])
    if width is not None and stats.width != width:
        warnings.warn(
            f"{path} covers {stats.width} drafts per block, the drafter drafts {width}: ignored "
            f"(refit it: python -m flashspark fit-prior)",
            stacklevel=2,
        )
        return None
    return stats.scaled(SHIPPED_PRIOR_ROWS)


def _random_prompts(target, batch_size: int, context_len: int) -> list[list[int]]:
    """The fixed random prompts the step measurements decode (what a step costs does not
    depend on what it reads)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(2, target.config.vocab_size, (batch_size, context_len), generator=gen).tolist()


@torch.no_grad()
def measured_step_seconds(
    target,
    drafter,
    batch_size: int,
    path: str = "auto",
    context_len: int = 64,
    steps: int = 6,
    tree: int = 0,
    temperature: float = 0.0,
    k: int | None = None,
) -> float:
    """Wall seconds of one whole loop step (draft, verify forward of K + 1 tokens per request,
    verify, commit, injection) for `batch_size` requests, from a short run (greedy, or sampled
    at `temperature`: sampling costs a step more) with fixed K = `k` (default: the drafter's
    drafts per block; a tree: all its nodes) on random prompts. Measured inside the loop on
    purpose: there the drafter and the target take turns and evict each other's weights from the
    caches, so the target's forward costs more than when it runs alone (as `profile_sps` times it)."""
    scheduler = None if k is None or tree else FixedK(min(k, drafter.num_drafts))
    k = drafter.num_drafts if scheduler is None else scheduler.max_spec_len
    prompts = _random_prompts(target, batch_size, context_len)

    def run(new_tokens):
        return speculative_generate(
            target,
            drafter,
            prompts,
            max_new_tokens=new_tokens,
            temperature=temperature,
            scheduler=scheduler,
            path=path,
            tree=tree,
        )

    run(2)  # warm-up
    _, st = run(steps * (k + 1))
    # Per loop iteration: the batch runs until its slowest request is done (request-steps over
    # the batch size would charge the finished requests' idle iterations to the others).
    return st["decode_seconds"] / max(1, st["iterations"])


def measured_plain_step_seconds(
    target, batch_size: int, context_len: int = 64, steps: int = 24, temperature: float = 0.0
) -> float:
    """Wall seconds of one step of plain decoding (`generate`: the forward, sampling, the
    loop's bookkeeping) for `batch_size` requests from `context_len` random prompt tokens."""
    prompts = _random_prompts(target, batch_size, context_len)
    generate(target, prompts, max_new_tokens=2, temperature=temperature)  # warm-up
    _, st = generate(target, prompts, max_new_tokens=steps, temperature=temperature)
    return st["decode_seconds"] / max(1, st["forwards"])


def measured_prefill_seconds(target, batch_size: int, prompt_len: int) -> float:
    """Wall seconds of plain decoding's prefill of `batch_size` random prompts of `prompt_len`
    tokens (its forward and its first token), after a warm-up."""
    prompts = _random_prompts(target, batch_size, prompt_len)
    generate(target, prompts, max_new_tokens=1)  # warm-up
    _, st = generate(target, prompts, max_new_tokens=1)
    return st["prefill_seconds"]


def _plain_decode(target, prompts, max_new_tokens, temperature, seed, eos_id):
    """Plain decoding with the speculative loop's stats keys (τ = 1, nothing drafted)."""
    out, st = generate(
        target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, eos_id=eos_id
    )
    steps = st["new_tokens"]  # one token per request-step
    return out, st | {
        "steps": steps,
        "tau": 1.0,
        "tau_per_request": [1.0] * len(prompts),
        "steps_per_request": [len(o) for o in out],
        "verified_per_step": 0.0,
        "drafts_verified": 0,
        "drafts_wasted": 0,
        "acceptance_per_position": [],
        "plain_steps": st["forwards"],
        "plain_batch": True,
        "phase_seconds": {"prefill": st["prefill_seconds"], "target": st["decode_seconds"]},
    }


def step_sps(
    target, drafter, batch_size: int, path: str = "auto", rounds: int = 5, tree: int = 0
) -> tuple[SPSTable, SPSTable]:
    """(speculative, plain) step rates: SPS(T) = 1 / (target verify forward of T tokens, padded
    to the cheapest width at or above it (`SPSTable.padded`), + the rest of a full-width step
    measured in the loop), and a plain decoding step (the forward's table scaled to the
    plain steps measured at T = batch size). The forward's table is cached on disk
    (`profile_sps`); a `Decoder` keeps the pair per batch size."""
    layers = drafter.config.target_layer_ids
    # Every verify width a step can take: 1 .. num_drafts + 1 tokens per request, or a tree's
    # nodes (beyond the table's end SPS would be read as flat, and the last draft as free).
    w = tree or drafter.num_drafts + 1  # tokens per request of a full-width verify forward
    widths = range(1, w + 1)
    forward = profile_sps(target, batch_size, [batch_size * w for w in widths], hidden_layers=layers)
    padded = forward.padded()  # a speculative step runs its verify at the cheapest width at or above it
    # What decides is a speculative step against a plain one, so both are measured as they
    # run, back to back, median of `rounds` (a shared machine's slow spells then land on both):
    # a full-width speculative step in the loop, and a plain decoding step (`generate`). The
    # profile gives only the shape in between. A profiled forward is not what a step costs:
    # inside the loop the drafter and the target evict each other's weights, and plain
    # decoding runs no feature taps (on SmolLM2 in fp32 at batch 8 the profile's one-token
    # forward read 102 ms where plain decoding's steps measured 72-87 ms, and the prior
    # predicted a gain where speculation ran at 0.85x).
    spec_steps, plain_steps = [], []
    for _ in range(rounds):
        spec_steps.append(measured_step_seconds(target, drafter, batch_size, path, tree=tree))
        plain_steps.append(measured_plain_step_seconds(target, batch_size))
    full = 1.0 / float(forward.rate(batch_size * w))
    overhead = max(0.0, statistics.median(spec_steps) - full)
    scale = statistics.median(plain_steps) * float(forward.rate(batch_size))
    return padded.with_overhead(overhead), SPSTable(forward.tokens.tolist(), (forward.sps / scale).tolist())


class Decoder:
    """A method ready to decode: `decoder(prompts, max_new_tokens, temperature, seed, eos_id=None,
    record=False) -> (outputs, stats)`. It owns everything its schedulers learn and reuse: the
    step-rate tables per batch size, the confidence proxy per temperature (updated online
    across calls), the confidence stats per temperature (the shipped prior plus every batch
    since) and the measured step costs. `prepare(batch_size, temperature)` does a confidence
    scheduler's one-off work (SPS profiling, proxy loading) ahead of any timed call."""

    def __init__(self, spec: MethodSpec | str, target, drafter=None, drafter_dir: str | Path | None = None):
        self.spec = parse_method(spec) if isinstance(spec, str) else spec
        self.target = target
        # A drafter's proxy and scheduler prior sit in its directory; one built in memory and
        # passed without a directory has none.
        self.drafter_dir = Path(drafter_dir) if drafter_dir else None
        if drafter is None:
            self.drafter_dir = drafter_dir_of(self.spec.drafter, drafter_dir, target)
            drafter = load_method_drafter(self.spec.drafter, target, self.drafter_dir)
        self.drafter = drafter
        self.k_max = (
            self.spec.tree - 1 if self.spec.tree else drafter.num_drafts if self.spec.k is None else self.spec.k
        )
        self.proxies: dict[float, ConfidenceProxy] = {}
        self.priors: dict[float, ConfidenceStats | None] = {}
        self.step_costs: dict[int, tuple[float, int]] = {}  # per batch size: measured / predicted step seconds
        self.sps: dict[int, tuple[SPSTable, SPSTable]] = {}  # per batch size: (speculative, plain) step rates
        self.verdict = BatchVerdict()  # per batch size and temperature: speculate or decode plainly

    def prepare(self, batch_size: int, temperature: float) -> None:
        self.scheduler_for(batch_size, temperature)

    def forget(self) -> None:
        """Drop what calls have taught (verdicts, the priors' and proxies' online updates, measured
        step costs), keeping the one-off step-rate profiles: a warm-up call must not decide how
        the calls measured after it decode."""
        self.proxies, self.priors, self.step_costs = {}, {}, {}
        self.verdict = BatchVerdict()

    def scheduler_for(self, batch_size: int, temperature: float, prior=None, step_prior=None):
        spec, drafter = self.spec, self.drafter
        if spec.scheduler == "fixed":
            return FixedK(self.k_max)
        source = None
        if spec.drafter == "dflash2":
            if temperature not in self.proxies:
                self.proxies[temperature] = load_proxy(
                    self.drafter_dir or data.ASSETS_DIR / "dflash2",
                    temperature,
                    device=next(drafter.parameters()).device,
                )
            source = self.proxies[temperature].for_scheduler(online=spec.online)
        if batch_size not in self.sps:
            self.sps[batch_size] = step_sps(self.target, drafter, batch_size, spec.path, tree=spec.tree)
        spec_sps, plain_sps = self.sps[batch_size]
        return ConfidenceScheduler(
            self.k_max,
            spec_sps,
            padded=spec.price == "padded",
            batch_verdict=True,  # `__call__` decides whole batches with its BatchVerdict
            delay=spec.delay,
            admission=spec.admission,
            confidence_fn=source,
            plain_sps=plain_sps if spec.plain_steps else None,
            min_rows=MIN_PRIOR_ROWS,
            prior=prior,
            step_prior=step_prior,
            time_steps=True,
        )

    def __call__(self, prompts, max_new_tokens, temperature=0.0, seed=0, eos_id=None, record=False):
        spec, B = self.spec, len(prompts)
        # Per temperature: the confidence stats of the shipped prior and earlier calls. Once
        # MIN_PRIOR_ROWS rows back them, they predict what speculation gains at a batch size.
        if temperature not in self.priors:
            # (The shipped prior is per block position: a tree's columns are nodes.)
            confident_method = spec.scheduler == "confidence" and not spec.tree
            self.priors[temperature] = (
                load_prior(self.drafter_dir, temperature, self.drafter.num_drafts)
                if confident_method and self.drafter_dir
                else None
            )
        prior = self.priors[temperature]
        scheduler = self.scheduler_for(B, temperature, prior, self.step_costs.get(B))
        confident = isinstance(scheduler, ConfidenceScheduler) and spec.plain_steps
        key = (B, temperature)
        if confident and not record:
            # Speculate or decode the batch plainly: a bandit over both's measured tokens/s
            # (scheduling/verdict.py), the prior's predicted gain until there are measurements
            # (the verdict's own margin decides ties; `min_gain` is the margin of the scheduler's
            # step-by-step gate, which no measurement corrects).
            predicted = None  # no prior: speculation runs first, its measurements decide
            if prior is not None and prior.rows >= scheduler.min_rows:
                survival = conditional(prior.mean_survival())
                predicted = scheduler.predicted_gain(survival, B, new_tokens=max_new_tokens)
            if not self.verdict.choose(key, predicted, requests=B):
                out, stats = _plain_decode(self.target, prompts, max_new_tokens, temperature, seed, eos_id)
                self.verdict.record(key, False, stats["tokens_per_s"], self.plain_estimate(B, out, stats))
                return out, stats
        out, stats = speculative_generate(
            self.target,
            self.drafter,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            eos_id=eos_id,
            scheduler=scheduler,
            path=spec.path,
            record=record,
            tree=spec.tree,
            search=spec.search,
        )
        if confident and scheduler.stats is not None:
            self.priors[temperature] = scheduler.stats  # the prior plus this batch
            self.step_costs[B] = scheduler.step_cost_totals()
        if confident and not record:
            self.verdict.record(key, True, stats["tokens_per_s"], self.plain_estimate(B, out, stats))
        return out, stats

    def plain_estimate(self, batch_size: int, outputs, stats) -> float | None:
        """Tokens/s plain decoding is estimated to reach on a batch just decoded: its prefill,
        then one plain step per token of its longest output after the first (the prefill draws
        it), at the profiled forward's step time. For a speculative batch the counterfactual
        plain rate; for a plain one the same estimator's figure, whose error the verdict takes
        out of the former (scheduling/verdict.py)."""
        steps = max((len(o) for o in outputs), default=0) - 1
        if batch_size not in self.sps:
            return None
        step = 1.0 / float(self.sps[batch_size][1].rate(batch_size))
        seconds = stats["prefill_seconds"] + max(0, steps) * step
        return stats["new_tokens"] / seconds if seconds > 0 else None


def make_decoder(spec: MethodSpec | str, target, drafter=None, drafter_dir: str | Path | None = None) -> Decoder:
    """The `Decoder` of a method (see there)."""
    return Decoder(spec, target, drafter, drafter_dir)
