"""Deterministic generated corpora for the CI-sized recipes (no downloads): learnable, with realistic
(lognormal) length distributions so that bucketing matters."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

_POSITIVE = (
    "great excellent love wonderful perfect amazing superb fantastic delightful brilliant sturdy reliable "
    "recommend happy pleased beautiful comfortable durable impressive flawless charming elegant fun"
).split()
_NEGATIVE = (
    "terrible awful hate broken useless poor disappointing horrible worst cheap flimsy faulty refund "
    "returned waste annoying defective ugly painful boring mediocre leaking noisy late"
).split()
_NEUTRAL = (
    "the a an it this that product item book movie phone case battery screen box price color size "
    "shipping order package day week month year time use used using after before with without for "
    "and but or so very quite really just also still then when while because although my our your "
    "their i we you they he she was is are were be been have has had do did does arrived came works "
    "work looks look feels feel sound sounds read reading watch watched bought buy gift kids family "
    "home kitchen office car travel daily first second last new old small large light heavy"
).split()
_NOUNS = "cat dog bird farmer teacher child river mountain city garden ship train letter song storm".split()
_ADJS = "old young quiet loud small large bright dark happy tired clever gentle swift patient".split()
_VERBS = "sees finds follows carries paints watches builds visits remembers greets crosses hears".split()
_PLACES = "near the river|in the city|by the mountain|under the bridge|across the field|behind the house".split("|")


def _length(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(round(math.exp(rng.gauss(math.log(median), sigma))))))


def sentiment_reviews(n: int, seed: int, median_words: float = 28.0, sigma: float = 0.7) -> list[dict]:
    """Amazon-Polarity-shaped records: {'content': str, 'label': 0|1}. The label is carried by sentiment words."""
    return list(iter_sentiment_reviews(n, seed, median_words, sigma))


def iter_sentiment_reviews(n: int, seed: int, median_words: float = 28.0, sigma: float = 0.7) -> Iterator[dict]:
    """`sentiment_reviews` one record at a time (the same records, in the same order)."""
    rng = random.Random(f"sentiment:{seed}")
    for _ in range(n):
        label = rng.randint(0, 1)
        words = []
        for _ in range(_length(rng, median_words, sigma, 4, 600)):
            r = rng.random()
            if r < 0.25:
                words.append(rng.choice(_POSITIVE if label else _NEGATIVE))
            elif r < 0.29:
                words.append(rng.choice(_NEGATIVE if label else _POSITIVE))
            else:
                words.append(rng.choice(_NEUTRAL))
        yield {"content": " ".join(words), "label": label}


def _sentence(rng: random.Random) -> str:
    subject = f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"
    obj = f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"
    tail = f" {rng.choice(_PLACES)}" if rng.random() < 0.5 else ""
    return f"{subject} {rng.choice(_VERBS)} {obj}{tail} ."


def story_text(n: int, seed: int, median_words: float = 40.0, sigma: float = 0.6) -> list[dict]:
    """Short documents of templated sentences for causal-LM recipes: {'text': str}."""
    return list(iter_story_text(n, seed, median_words, sigma))


def iter_story_text(n: int, seed: int, median_words: float = 40.0, sigma: float = 0.6) -> Iterator[dict]:
    """`story_text` one record at a time (the same records, in the same order)."""
    rng = random.Random(f"text:{seed}")
    for _ in range(n):
        target = _length(rng, median_words, sigma, 6, 800)
        sentences, words = [], 0
        while words < target:
            s = _sentence(rng)
            sentences.append(s)
            words += len(s.split())
        yield {"text": " ".join(sentences)}


_QUESTIONS = ("what does the {adj} {noun} do ?", "tell me about the {adj} {noun} .", "and the {adj} {noun} ?")
_SYSTEM = "you answer questions about the story ."


def iter_conversations(n: int, seed: int, turns_median: float = 2.0) -> Iterator[dict]:
    """Chat records for the SFT recipes: {'messages': [{role, content}, ...]}: an optional system message, then
    user questions about a short story and assistant answers that repeat facts of it (learnable)."""
    rng = random.Random(f"chat:{seed}")
    for _ in range(n):
        story = [_sentence(rng) for _ in range(rng.randint(1, 3))]
        messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.5 else []
        for turn in range(_length(rng, turns_median, 0.5, 1, 4)):
            fact = rng.choice(story).split()
            subject, verb, obj = " ".join(fact[:3]), fact[3], " ".join(fact[4:7])
            question = rng.choice(_QUESTIONS).format(adj=fact[1], noun=fact[2])
            context = " ".join(story) + " " if turn == 0 else ""
            messages.append({"role": "user", "content": context + question})
            messages.append({"role": "assistant", "content": f"{subject} {verb} {obj} ."})
        yield {"messages": messages}
