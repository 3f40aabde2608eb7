"""General-chat prompts that the target writes itself (Magpie-style self-instruct), for `train
data --kinds self:N,...`.

Every other prompt kind comes from the Python standard library, and drafters trained on it
alone do not generalise to what people ask a chat model (cooking, history, email, ...). No
dataset can be downloaded here, so the target writes the requests: it reads its chat template
up to the start of the user's turn, then a seed opener naming a topic ("Tell me about
sourdough bread"), and samples the rest of the request until its end-of-turn token. The
request is then rendered as an ordinary user turn and answered like any chat prompt.

A seed is (opener, topic, round). Topics are split by index: every 10th is held out and the
5th of each ten goes to calibration, so the held-out general-chat requests never share a topic
with the training ones: every request starts with its seed's text, which names its topic, so no
held-out request can equal a training one.
Rounds repeat the (opener, topic) grid with other samples, for data beyond one pass.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

SENTINEL = "\x00USER\x00"  # stands for the user's message when the template is cut at its start
REQUEST_MAX_TOKENS = 48  # a request longer than this is cut off and dropped
REQUEST_MIN_CHARS = 12
REQUEST_TEMPERATURE = 1.0
ROUNDS = {"train": 8, "calibration": 1, "heldout": 1}

OPENERS = (
    "Tell me about {t}",
    "Can you explain {t}",
    "Write a short email about {t}",
    "Give me some practical tips on {t}",
    "What is the history of {t}",
    "How do I get started with {t}",
    "Write a short story that involves {t}",
    "What are the pros and cons of {t}",
    "Help me plan {t}",
    "Write a poem about {t}",
    "Explain to a ten-year-old {t}",
    "What are common mistakes people make with {t}",
    "I need advice about {t}",
    "Summarize the key facts about {t}",
    "Compare different approaches to {t}",
    "What questions should I ask about {t}",
)

TOPICS = (
    "baking sourdough bread",
    "the French Revolution",
    "black holes",
    "writing a cover letter",
    "training for a marathon",
    "growing tomatoes",
    "the Roman Empire",
    "photosynthesis",
    "saving for retirement",
    "learning a second language",
    "a weekend trip to Paris",
    "meditation",
    "the water cycle",
    "negotiating a salary",
    "making pasta from scratch",
    "the Industrial Revolution",
    "climate change",
    "job interviews",
    "house plants",
    "the human immune system",
    "budgeting for a family",
    "the history of jazz",
    "volcanoes",
    "a birthday party for a child",
    "time management",
    "electric cars",
    "the Renaissance",
    "vegetarian cooking",
    "adopting a dog",
    "the solar system",
    "writing a wedding speech",
    "public speaking",
    "ancient Egypt",
    "machine learning",
    "first aid",
    "buying a used car",
    "the Cold War",
    "healthy breakfast ideas",
    "starting a small business",
    "the ocean tides",
    "camping in the mountains",
    "Shakespeare's plays",
    "sleep habits",
    "renting an apartment",
    "the theory of evolution",
    "a complaint to a landlord",
    "chess openings",
    "World War I",
    "composting at home",
    "the stock market",
    "learning to play guitar",
    "thank-you notes",
    "the Moon landing",
    "coffee brewing",
    "dealing with stress",
    "the printing press",
    "planning a garden",
    "earthquakes",
    "making friends as an adult",
    "the Silk Road",
    "knitting",
    "credit scores",
    "the human brain",
    "a team meeting agenda",
    "Greek mythology",
    "home workouts",
    "recycling",
    "the Great Wall of China",
    "writing a resume",
    "rainforests",
    "the history of the Olympics",
    "cooking rice",
    "moving to a new city",
    "the periodic table",
    "customer service emails",
    "birdwatching",
    "the American Civil War",
    "meal prep for the week",
    "studying for exams",
    "renewable energy",
    "painting with watercolors",
    "the Vikings",
    "a road trip across the country",
    "vaccines",
    "apologizing to a friend",
    "impressionist painters",
    "the internet's history",
    "a job resignation letter",
    "dinosaurs",
    "making soup",
    "photography for beginners",
    "the Industrial age of steam",
    "organizing a closet",
    "the Mayan civilization",
    "nutrition labels",
    "a book club discussion",
    "the history of medicine",
    "hiking safety",
    "writing a haiku",
    "the economy of inflation",
    "baking cookies",
    "honey bees",
    "the Middle Ages",
    "volunteering",
    "an email to a professor",
    "the speed of light",
    "caring for a cat",
    "the history of chocolate",
    "indoor herb gardens",
    "the French language",
    "a first date",
    "weather forecasts",
    "the pyramids",
    "personal finance apps",
    "yoga",
    "the Amazon river",
    "a product review",
    "the invention of the telephone",
    "grilling vegetables",
    "learning to swim",
)


@dataclass(frozen=True)
class Seed:
    """One self-instruct prompt before the target writes it: the forced start of the request."""

    opener: str
    topic: str
    round: int

    @property
    def text(self) -> str:
        return self.opener.format(t=self.topic)


def topic_split(index: int) -> str:
    return "heldout" if index % 10 == 0 else "calibration" if index % 10 == 5 else "train"


def seed_set(split: str) -> list[Seed]:
    """The seeds of a split in a fixed order: round by round, each round the (opener, topic) grid
    in a fixed pseudo-random order (so that any prefix mixes topics and openers)."""
    topics = [t for i, t in enumerate(TOPICS) if topic_split(i) == split]
    if not topics:
        raise ValueError(f"unknown split {split!r}")
    grid = [(o, t) for o in range(len(OPENERS)) for t in range(len(topics))]
    random.Random(f"self-instruct {split}").shuffle(grid)
    return [Seed(OPENERS[o], topics[t], r) for r in range(ROUNDS[split]) for o, t in grid]


def pre_query(chat_template) -> str:
    """The chat template's text up to where the user's message starts (its system turn, if any,
    and the user turn's header)."""
    text = chat_template([{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise ValueError("the chat template does not quote the user's message")
    return text[: text.index(SENTINEL)]


@torch.no_grad()
def write_requests(target, tokenizer, chat_template, seeds: list[Seed], stop_ids, gen, continue_batch):
    """The requests the target writes from `seeds` (None where it wrote nothing usable: empty,
    too short, or not finished within REQUEST_MAX_TOKENS). `continue_batch` is
    target_data.continue_batch (sampled at REQUEST_TEMPERATURE with `gen`)."""
    head = pre_query(chat_template)
    prompts = [tokenizer.encode(head + s.text, add_special_tokens=False).ids for s in seeds]
    rows = continue_batch(target, prompts, REQUEST_MAX_TOKENS, [0], stop_ids, 1, REQUEST_TEMPERATURE, gen)
    out = []
    for s, p, row in zip(seeds, prompts, rows):
        new = row["tokens"][len(p) :].tolist()
        if not new or new[-1] not in stop_ids:
            out.append(None)
            continue
        request = (s.text + tokenizer.decode(new[:-1])).strip()
        out.append(request if len(request) >= REQUEST_MIN_CHARS else None)
    return out
