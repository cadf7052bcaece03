#!/usr/bin/env python3
"""Writes data/corpus.txt: about 200 KB of English prose for `rumble train`'s byte-level demo.

The text is generated from a small hand-written grammar (no outside source), so the corpus is
ours to ship. It is seeded, so running this script again gives the same file byte for byte:

    python3 data/make_corpus.py > data/corpus.txt

The prose is simple on purpose: a tiny model should be able to learn its spelling, punctuation
and common phrases within a few hundred steps on a CPU.
"""
import random

rng = random.Random(20261202)

PEOPLE = ["the miller", "the old captain", "a young clerk", "the keeper of the lighthouse", "my grandmother",
          "the schoolmaster", "a tired traveller", "the baker's daughter", "the ferryman", "a quiet stranger",
          "the village doctor", "the blacksmith", "the widow Marlow", "the shepherd", "the harbour master",
          "a boy named Tom", "the parson", "a girl named Ada", "the clockmaker", "the postman"]
PLACES = ["the river", "the market square", "the harbour", "the long road to the north", "the chapel on the hill",
          "the edge of the forest", "the mill pond", "the lighthouse", "the narrow bridge", "the inn by the crossroads",
          "the orchard", "the station", "the empty schoolhouse", "the salt marsh", "the garden wall"]
THINGS = ["a lantern", "a letter sealed with wax", "an old map", "a basket of apples", "a broken clock",
          "a silver key", "a pair of boots", "a loaf of bread", "a small wooden box", "a bundle of papers",
          "a compass", "a blue umbrella", "a jar of honey", "a bell", "a book with no title"]
ADJ = ["cold", "grey", "quiet", "bright", "heavy", "narrow", "strange", "gentle", "wet", "golden", "dark",
       "warm", "long", "patient", "restless", "careful", "sudden", "pale", "crooked", "familiar"]
TIMES = ["In the morning", "Before dawn", "At noon", "Late in the evening", "After the storm", "On Sunday",
         "Every winter", "That summer", "When the bell rang", "Long before the railway came", "At midnight",
         "In the spring", "The next day", "Some years later", "While the town slept"]
WEATHER = ["the wind came in from the sea", "rain fell on the roofs", "a fog lay over the fields",
           "the sun was low and red", "snow covered the road", "the air smelled of smoke and salt",
           "the sky cleared", "the clouds hung low over the hills", "the frost made the grass white"]
VERBS_T = ["carried", "found", "lost", "opened", "mended", "hid", "sold", "remembered", "wrapped", "counted",
           "buried", "painted", "returned", "weighed", "read"]
VERBS_I = ["waited", "listened", "laughed", "walked on", "sat down", "looked away", "said nothing", "hurried home",
           "stood still", "began to sing", "fell asleep", "kept walking"]
FEELINGS = ["glad", "afraid", "puzzled", "tired", "hopeful", "ashamed", "curious", "content", "uneasy", "proud"]
SAYINGS = ["It is later than you think", "Nothing is lost that can be found again", "The road knows its own way",
           "Bread first, and then the news", "A kind word costs nothing", "Count twice and cut once",
           "The sea gives and the sea takes", "Every clock is right sometimes", "Go slowly, and you go far",
           "What the wind brings, the wind takes away"]
NAMES = ["Ada", "Tom", "Mrs Marlow", "the captain", "the miller", "the doctor", "the clerk", "the postman"]


def cap(s):
    return s[0].upper() + s[1:]


def pick(xs):
    return rng.choice(xs)


# One sentence template each; the random picks run left to right, as they read.
TEMPLATES = [
    lambda: f"{pick(TIMES)}, {pick(WEATHER)}.",
    lambda: f"{cap(pick(PEOPLE))} {pick(VERBS_T)} {pick(THINGS)} near {pick(PLACES)}.",
    lambda: f"{cap(pick(PEOPLE))} {pick(VERBS_I)}, and {pick(PEOPLE)} {pick(VERBS_I)}.",
    lambda: f"The {pick(ADJ)} light fell across {pick(PLACES)}, and for a while nobody spoke.",
    lambda: f"\"{pick(SAYINGS)},\" said {pick(NAMES)}.",
    lambda: f"{cap(pick(PEOPLE))} was {pick(FEELINGS)}, though {pick(['he', 'she', 'they'])} could not say why.",
    lambda: f"There were {rng.randrange(2, 12)} {pick(['boats', 'houses', 'lamps', 'sheep', 'letters', 'windows'])} "
            f"by {pick(PLACES)}, and each of them was {pick(ADJ)}.",
    lambda: f"{pick(TIMES)}, {pick(PEOPLE)} went down to {pick(PLACES)} with {pick(THINGS)}.",
    lambda: f"\"Have you seen {pick(THINGS)}?\" asked {pick(NAMES)}. \"I left it by {pick(PLACES)}.\"",
    lambda: f"Nobody in the town remembered who had {pick(VERBS_T)} {pick(THINGS)}, but everyone had a story about it.",
    lambda: f"It was a {pick(ADJ)}, {pick(ADJ)} day, and {pick(WEATHER)}.",
    lambda: f"{cap(pick(PEOPLE))} {pick(VERBS_I)} until {pick(WEATHER)}.",
]


def sentence():
    return TEMPLATES[rng.randrange(len(TEMPLATES))]()


def paragraph():
    return " ".join(sentence() for _ in range(rng.randrange(3, 8)))


def main(target_bytes=200_000):
    out = ["THE TOWN BY THE WATER\n", "A book of small stories, written for a very small language model.\n"]
    size, chapter = sum(len(s) for s in out), 0
    while size < target_bytes:
        chapter += 1
        head = f"\nCHAPTER {chapter}. {cap(pick(ADJ))} {pick(['Weather', 'News', 'Visitors', 'Lights', 'Roads', 'Letters', 'Bells'])}\n\n"
        out.append(head)
        size += len(head)
        for _ in range(rng.randrange(4, 9)):
            p = paragraph() + "\n\n"
            out.append(p)
            size += len(p)
    print("".join(out).rstrip() + "\n", end="")


if __name__ == "__main__":
    main()
