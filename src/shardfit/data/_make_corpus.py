"""Regenerate corpus.txt: self-written English prose, deterministic (seeded), no download.

    python -m shardfit.data._make_corpus > src/shardfit/data/corpus.txt

The text is simple on purpose: a tiny model must be able to lower its loss on it within a few
steps, and the byte-level statistics of real English (spaces, common words, punctuation) are
what the smoke tests need. Paragraphs vary in length so dynamic padding and length grouping matter.
"""
from __future__ import annotations

import random

PEOPLE = ["the miller", "the old sailor", "a young teacher", "the baker", "my grandmother", "the farmer",
          "a tired traveller", "the lighthouse keeper", "the carpenter", "a quiet student", "the doctor",
          "the fisherman", "the mayor", "a curious child", "the gardener", "the clockmaker"]
PLACES = ["the harbour", "the market", "the narrow valley", "the village square", "the library",
          "the river bank", "the high meadow", "the station", "the orchard", "the workshop", "the school",
          "the old bridge", "the forest path", "the kitchen", "the hill above the town"]
THINGS = ["a lantern", "a wooden box", "a letter", "a basket of apples", "an old map", "a silver key",
          "a loaf of bread", "a small boat", "a book of songs", "a broken clock", "a warm coat",
          "a jar of honey", "a bundle of firewood", "a pair of boots", "a painted cup"]
VERBS = ["carried", "found", "mended", "sold", "gave away", "painted", "hid", "lost", "kept", "opened",
         "counted", "cleaned", "wrapped", "remembered", "borrowed"]
TIMES = ["In the morning", "Before dawn", "Late in the evening", "On a cold winter day", "Every spring",
         "After the storm", "At noon", "On market day", "When the bells rang", "Long ago",
         "During the long summer", "On the first day of autumn"]
WEATHER = ["the rain fell softly on the roofs", "a bright sun warmed the stones",
           "the wind came down from the mountains", "fog covered the fields", "snow lay deep on the roads",
           "the sky was clear and blue", "thunder rolled far away", "the air smelled of salt and pine"]
FEELINGS = ["happy", "worried", "patient", "surprised", "calm", "proud", "lonely", "hopeful", "careful"]
REASONS = ["because the winter would be long", "because a friend had asked for help",
           "so that nobody would be hungry", "because it was the right thing to do",
           "although nobody was watching", "because the road was dangerous", "for the festival",
           "so that the children could learn", "before anyone else woke up"]
FACTS = [
    "Water boils at one hundred degrees at the level of the sea.",
    "A year has twelve months, and most months have thirty or thirty one days.",
    "Bees carry pollen from flower to flower and make honey in their hives.",
    "The moon goes around the earth about once every twenty nine days.",
    "Trees grow a new ring of wood every year, so the rings tell their age.",
    "Bread is made from flour, water, salt and yeast, and it rises in a warm place.",
    "A clock has two hands: the short one shows the hours and the long one shows the minutes.",
    "Rivers run from the hills to the sea, and they carry sand and small stones with them.",
    "Birds build nests in spring and many of them fly south before the winter.",
    "Two and two make four, three times three makes nine, and ten minus one is nine.",
]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    person, place, thing = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(THINGS)
    if kind == 0:
        return f"{rng.choice(TIMES)}, {person} {rng.choice(VERBS)} {thing} near {place}."
    if kind == 1:
        return f"{rng.choice(TIMES)}, {rng.choice(WEATHER)}, and {person} felt {rng.choice(FEELINGS)}."
    if kind == 2:
        return f"{person.capitalize()} {rng.choice(VERBS)} {thing} {rng.choice(REASONS)}."
    if kind == 3:
        return f"\"Where did you find {thing}?\" asked {person}. \"In {place.removeprefix('the ')},\" said {rng.choice(PEOPLE)}."
    if kind == 4:
        return rng.choice(FACTS)
    return f"At {place}, {rng.choice(WEATHER)}, so {person} stayed inside and {rng.choice(VERBS)} {thing}."


def corpus(target_bytes: int = 300_000, seed: int = 7) -> str:
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < target_bytes:
        # Lengths from one sentence to a dozen: real documents are ragged.
        text = " ".join(sentence(rng) for _ in range(rng.choice((1, 2, 3, 4, 6, 8, 12))))
        paragraphs.append(text)
        size += len(text) + 2
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    print(corpus(), end="")
