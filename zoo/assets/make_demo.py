"""Writes zoo/assets/demo/: the embedded demo's text, short stories and rhymes about a small zoo
by the sea, composed from the word lists and sentence patterns below (written for zoo; no text
is copied from anywhere). Seeded: running it again gives the same files.

    python zoo/assets/make_demo.py zoo/assets/demo
"""

import random
import sys
import textwrap
from pathlib import Path

rng = random.Random(1729)

ANIMALS = ["the old tortoise", "the grey heron", "the red fox", "the little otter", "the patient camel",
           "the spotted owl", "the young lion", "the striped zebra", "the quiet elephant", "the green parrot",
           "the sleepy bear", "the proud peacock", "the small penguin", "the clever crow", "the gentle giraffe"]
NAMES = ["Tamsin", "Odo", "Perrin", "Mirela", "Bastian", "Ilse", "Corvin", "Wren", "Anselm", "Hedda"]
PLACES = ["the north gate", "the pond by the willow", "the long wall", "the keeper's hut", "the stone bridge",
          "the orchard", "the sand yard", "the lantern path", "the high meadow", "the harbour steps"]
TIMES = ["At dawn", "In the evening", "Before the rain", "After the market closed", "On the first cold morning",
         "When the tide went out", "Late in the summer", "At noon", "Under the full moon", "In the grey hour"]
VERBS = ["walked slowly to", "hurried toward", "waited near", "looked across", "sang softly at",
         "counted the stones of", "slept beside", "wandered round", "listened at", "kept watch over"]
FEELINGS = ["glad", "uneasy", "curious", "tired", "hopeful", "quiet", "restless", "content", "puzzled", "brave"]
THINGS = ["a brass key", "a loaf of bread", "a blue feather", "an old map", "a paper boat", "a silver bell",
          "a basket of pears", "a lost glove", "a jar of honey", "a wooden flute"]
WEATHER = ["the wind came in from the sea", "the rain drummed on the roofs", "the fog lay low on the water",
           "the sun was warm on the sand", "the first snow fell", "the clouds ran east", "the air smelled of salt"]
SAYINGS = ["Slow feet still reach the gate.", "A shared pear tastes sweeter.", "Count the stars before you sleep.",
           "Every path remembers who walked it.", "Keep the lantern lit for late friends.",
           "Quiet water hears the most.", "What is lost at noon is found by evening."]
ENDINGS = ["all was still", "the bells rang low", "the lamps were lit", "the gulls flew home"]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def sentence() -> str:
    k = rng.randrange(8)
    a, b = rng.sample(ANIMALS, 2)
    if k == 0:
        return f"{rng.choice(TIMES)}, {a} {rng.choice(VERBS)} {rng.choice(PLACES)}."
    if k == 1:
        return f"{cap(a)} found {rng.choice(THINGS)} near {rng.choice(PLACES)} and felt {rng.choice(FEELINGS)}."
    if k == 2:
        return f"\"Have you seen {rng.choice(THINGS)}?\" asked {a}. \"No,\" said {b}, \"but I will help you look.\""
    if k == 3:
        return f"{cap(rng.choice(WEATHER))}, and {a} was {rng.choice(FEELINGS)}."
    if k == 4:
        return f"{rng.choice(NAMES)} the keeper gave {rng.choice(THINGS)} to {a}, who carried it to {rng.choice(PLACES)}."
    if k == 5:
        return f"{cap(a)} and {b} sat together until {rng.choice(WEATHER)}."
    if k == 6:
        return f"{cap(b)} said, \"{rng.choice(SAYINGS)}\""
    return f"Nobody knew why {a} {rng.choice(VERBS)} {rng.choice(PLACES)} every day, but {rng.choice(NAMES)} smiled about it."


def story() -> str:
    title = f"{cap(rng.choice(ANIMALS))} and {rng.choice(THINGS)}"
    paras = [textwrap.fill(" ".join(sentence() for _ in range(rng.randint(3, 6))), 78)
             for _ in range(rng.randint(2, 3))]
    return f"{title}\n\n" + "\n\n".join(paras)


def poem() -> str:
    a, p, w = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(WEATHER)
    lines = [f"{cap(a)} by {p},", f"{cap(w)};", f"{rng.choice(TIMES)} the keeper came,",
             f"And {rng.choice(ENDINGS)}.", "", f"{cap(rng.choice(SAYINGS))}",
             f"So {rng.choice(NAMES)} wrote, and so it stays,", f"For {rng.choice(ANIMALS)} and {rng.choice(ANIMALS)} both."]
    return "\n".join(lines)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.txt"):
        old.unlink()
    total, i = 0, 1
    while total < 60000:  # about 60 KB: enough to learn from in a minute, small to ship
        text = (story() if rng.random() < 0.75 else poem()) + "\n"
        (out / f"{i:03d}.txt").write_text(text)
        total += len(text)
        i += 1
    print(f"{i - 1} documents, {total} bytes in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
